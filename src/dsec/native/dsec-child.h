/*
 * dsec-child.h: the first and last steps of a process that an init starts for the edge
 * (dsec-shim in a container, dsec-guest in a microVM), inlined into both by the build.
 * Each step returns 0 or an errno; child_run reports a failure on the error pipe.
 */

/* The signal state a program expects: nothing blocked, SIGPIPE at its default. */
static void child_reset_signals(void) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
}

/* A Landlock domain of its own for the process and what it starts, restricting no file
 * access (the rights it handles are allowed beneath /): sibling domains cannot
 * ptrace-access each other, so what an earlier exec left running cannot open a later
 * exec's /proc/<pid>/mem (and rewrite a grader's memory) or /proc/<pid>/fd (and write into
 * its output). It must handle REFER (ABI 2): a domain that does not refuses every link or
 * rename across directories (EXDEV), so ABI 1 kernels get no domain. Needs no_new_privs
 * (set before). A kernel without Landlock (gVisor's, an old one) skips it. */
static int child_own_domain(void) {
    const uint64_t rights = (1ULL << 0) | (1ULL << 13); /* LANDLOCK_ACCESS_FS_EXECUTE, _REFER */
    long abi = syscall(444 /* landlock_create_ruleset */, NULL, 0, 1 /* _VERSION */);
    if (abi < 2) return 0;
    struct { uint64_t handled_access_fs; } attr = {rights};
    int rs = (int)syscall(444, &attr, sizeof attr, 0);
    if (rs < 0) return errno;
    struct __attribute__((packed)) { uint64_t allowed_access; int32_t parent_fd; } beneath = {rights, -1};
    beneath.parent_fd = open("/", O_PATH | O_CLOEXEC);
    int err = 0;
    if (beneath.parent_fd < 0 || syscall(445 /* landlock_add_rule */, rs, 1 /* PATH_BENEATH */, &beneath, 0) < 0 ||
        syscall(446 /* landlock_restrict_self */, rs, 0) < 0)
        err = errno;
    if (beneath.parent_fd >= 0) close(beneath.parent_fd);
    close(rs);
    return err;
}

/* stdio from in, out, err; the error pipe moved to 3 (close-on-exec, so it closes when the
 * exec succeeds); nothing else: no descriptor of the init reaches the program. */
static int child_stdio(int in, int out, int err, int *errfd) {
    if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) return errno;
    if (dup3(*errfd, 3, O_CLOEXEC) < 0) return errno;
    *errfd = 3;
    syscall(SYS_close_range, 4, ~0U, 0);
    return 0;
}

/* exec the program with envp; on failure (or a failed step before: `err`), tell the
 * parent why on the error pipe and exit 127. Never returns. */
static void child_run(int err, int errfd, char **argv, char **envp) {
    if (!err) {
        environ = envp;
        execvp(argv[0], argv);
        err = errno;
    }
    (void)!write(errfd, &err, sizeof err);
    _exit(127);
}
