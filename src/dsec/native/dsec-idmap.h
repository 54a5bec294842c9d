/*
 * dsec-idmap.h: idmapped read-only mounts of layer directories, shared by
 * dsec-shim (a sandbox's root) and dsec-trusted (a trusted command's root).
 * The build inlines this file where a helper includes it (native/__init__.py),
 * so each helper stays one static binary named by the digest of its source.
 *
 * The layer store keeps every tree owned by one canonical id range (container
 * id N is host id OFFSET + N). Each sandbox runs as a host id range of its own;
 * its layers are mounted through an idmap that shows the canonical owners as
 * the sandbox's, so the files keep their meaning inside while no id a sandbox
 * maps owns a single file of the store (MOUNT_ATTR_IDMAP, Linux >= 5.12; an
 * overlay stacks idmapped lowers since 5.19).
 *
 * Needs: errno.h fcntl.h sched.h signal.h stdio.h string.h sys/mount.h
 * sys/syscall.h sys/wait.h unistd.h.
 */

/* A user namespace whose uid and gid maps are "FROM TO COUNT" (no process stays
 * in it: it exists only to describe the idmap); an O_CLOEXEC fd on it, or -1
 * with errno set. */
static int idmap_userns(long from, long to, long count) {
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) < 0) return -1;
    /* A raw clone (no atfork handlers): the child is born in the new namespace
     * and only waits for the pipe to close. */
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, NULL, NULL, NULL, NULL);
    if (pid < 0) {
        int e = errno;
        close(sync[0]);
        close(sync[1]);
        errno = e;
        return -1;
    }
    if (pid == 0) {
        char c;
        close(sync[1]);
        while (read(sync[0], &c, 1) < 0 && errno == EINTR) {
        }
        _exit(0);
    }
    close(sync[0]);
    char path[64], map[96];
    int fd = -1, err = 0;
    int len = snprintf(map, sizeof map, "%ld %ld %ld\n", from, to, count);
    const char *files[] = {"uid_map", "gid_map"};
    for (int i = 0; i < 2 && !err; i++) {
        snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, files[i]);
        int m = open(path, O_WRONLY | O_CLOEXEC);
        if (m < 0 || write(m, map, (size_t)len) != len) err = errno ? errno : EIO;
        if (m >= 0) close(m);
    }
    if (!err) {
        snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) err = errno;
    }
    close(sync[1]);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    if (err) {
        if (fd >= 0) close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/* Mount a read-only clone of the directory SRC on MOUNTPOINT, its owners shown
 * through the idmap of USERNS (as they are when USERNS < 0); 0, or -1 with errno
 * set. The clone is made in the caller's mount namespace. */
static int idmap_bind(const char *src, const char *mountpoint, int userns) {
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (tree < 0) return -1;
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY};
    if (userns >= 0) {
        attr.attr_set |= MOUNT_ATTR_IDMAP;
        attr.userns_fd = (uint64_t)userns;
    }
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0 ||
        syscall(SYS_move_mount, tree, "", AT_FDCWD, mountpoint, MOVE_MOUNT_F_EMPTY_PATH) < 0) {
        int e = errno;
        close(tree);
        errno = e;
        return -1;
    }
    close(tree);
    return 0;
}
