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

/* The running kernel's Landlock ABI version (0: none: gVisor's kernel, an old one). */
static long landlock_abi(void) {
    long abi = syscall(444 /* landlock_create_ruleset */, NULL, 0, 1 /* _VERSION */);
    return abi < 0 ? 0 : abi;
}

/* Put the calling thread in a new Landlock domain nested in its current one, restricting no
 * file access (the rights it handles are allowed beneath /) and scoping what `scoped` names
 * (LANDLOCK_SCOPE_SIGNAL, ABI 6: signals only to its own domain and those nested in it; 0:
 * nothing). It must handle REFER (ABI 2): a domain that does not refuses every link or
 * rename across directories (EXDEV). Needs no_new_privs. */
static int landlock_domain(uint64_t scoped) {
    const uint64_t rights = (1ULL << 0) | (1ULL << 13); /* LANDLOCK_ACCESS_FS_EXECUTE, _REFER */
    struct { uint64_t handled_access_fs, handled_access_net, scoped; } attr = {rights, 0, scoped};
    int rs = (int)syscall(444, &attr, scoped ? sizeof attr : sizeof attr.handled_access_fs, 0);
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

/* A Landlock domain of its own for the process and what it starts: sibling domains cannot
 * ptrace-access each other, so what an earlier exec left running cannot open a later exec's
 * /proc/<pid>/mem (and rewrite a grader's memory), /proc/<pid>/environ or /proc/<pid>/fd (and
 * write into its output). It scopes nothing (signals: the levels, dsec-landlock.h and
 * dsec-levels.h). ABI 1 kernels (no REFER) and kernels without Landlock get no domain. */
static int child_own_domain(void) {
    return landlock_abi() < 2 ? 0 : landlock_domain(0);
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
