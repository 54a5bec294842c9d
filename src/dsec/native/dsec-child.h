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
