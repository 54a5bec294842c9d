/* dsec-guest's setup of the guest, inlined into dsec-guest.c where it is included (one file to
 * build; see dsec/native/__init__.py): modules, network, disks and the root, cgroups, masked
 * paths, entropy and clock, and the setup and resume messages of the edge. */

/* --- setup ----------------------------------------------------------------------------- */

static int write_file(int dir, const char *path, const char *text) {
    int fd = openat(dir, path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

static int load_modules(void) {
    DIR *d = opendir("/modules");
    if (!d) return -1;
    struct dirent **names;
    int n = scandir("/modules", &names, NULL, alphasort);
    closedir(d);
    for (int i = 0; i < n; i++) {
        if (names[i]->d_name[0] != '.') {
            char path[300];
            snprintf(path, sizeof path, "/modules/%s", names[i]->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0 || (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST)) return -1;
            close(fd);
            unlink(path);
        }
        free(names[i]);
    }
    free(names);
    rmdir("/modules");
    return 0;
}

static int set_address(const char *ifname, const char *cidr, const char *gateway) {
    char addr[64];
    snprintf(addr, sizeof addr, "%s", cidr);
    char *slash = strchr(addr, '/');
    int prefix = slash ? atoi(slash + 1) : 32;
    if (slash) *slash = 0;
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", ifname);
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    sin->sin_family = AF_INET;
    int rc = -1;
    if (inet_pton(AF_INET, addr, &sin->sin_addr) != 1 || ioctl(s, SIOCSIFADDR, &ifr) < 0) goto out;
    sin->sin_addr.s_addr = prefix ? htonl(~0U << (32 - prefix)) : 0;
    if (ioctl(s, SIOCSIFNETMASK, &ifr) < 0) goto out;
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) goto out;
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) goto out;
    if (gateway[0]) {
        struct rtentry rt;
        memset(&rt, 0, sizeof rt);
        ((struct sockaddr_in *)&rt.rt_dst)->sin_family = AF_INET;
        ((struct sockaddr_in *)&rt.rt_genmask)->sin_family = AF_INET;
        struct sockaddr_in *gw = (struct sockaddr_in *)&rt.rt_gateway;
        gw->sin_family = AF_INET;
        if (inet_pton(AF_INET, gateway, &gw->sin_addr) != 1) goto out;
        rt.rt_flags = RTF_UP | RTF_GATEWAY;
        if (ioctl(s, SIOCADDRT, &rt) < 0) goto out;
    }
    rc = 0;
out:
    close(s);
    return rc;
}

static int lo_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    int rc = (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0 && (ifr.ifr_flags |= IFF_UP, ioctl(s, SIOCSIFFLAGS, &ifr)) == 0) ? 0 : -1;
    if (s >= 0) close(s);
    return rc;
}

static const struct { const char *name; int major, minor; } devices[] = {
    {"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0},
};

/* The disk whose virtio serial is `serial` ("l0".. the layers, "rw" the writable disk), as
 * /dev/vdX: the order the kernel names them in is not the order QEMU was given them in. */
static int find_disk(const char *serial, char *dev, size_t size) {
    DIR *d = opendir("/sys/block");
    if (!d) return -1;
    struct dirent *e;
    int rc = -1;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "vd", 2) != 0) continue;
        char path[300], got[64];
        snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, got, sizeof got - 1);
        close(fd);
        if (n <= 0) continue;
        got[n] = 0;
        if (got[n - 1] == '\n') got[n - 1] = 0;
        if (strcmp(got, serial) == 0) {
            snprintf(dev, size, "/dev/%s", e->d_name);
            rc = 0;
            break;
        }
    }
    closedir(d);
    if (rc < 0) errno = ENODEV;
    return rc;
}

/* The sandbox's root at /root: layers, writable disk, overlay, the kernel file systems. */
static int mount_root(int nlower) {
    static char opts[8192];
    char dev[300], dir[32], serial[8];
    size_t off = (size_t)snprintf(opts, sizeof opts, "lowerdir=");
    mkdir("/l", 0700);
    for (int i = 0; i < nlower; i++) {
        snprintf(serial, sizeof serial, "l%d", i);
        if (find_disk(serial, dev, sizeof dev) < 0) return -1;
        snprintf(dir, sizeof dir, "/l/%d", i);
        mkdir(dir, 0700);
        if (mount(dev, dir, "erofs", MS_RDONLY, NULL) < 0) return -1;
        off += (size_t)snprintf(opts + off, sizeof opts - off, "%s%s", i ? ":" : "", dir);
    }
    if (find_disk("rw", dev, sizeof dev) < 0) return -1;
    mkdir("/rw", 0700);
    if (mount(dev, "/rw", "ext4", MS_NOATIME, NULL) < 0) return -1;
    mkdir("/rw/upper", 0755);
    mkdir("/rw/work", 0700);
    snprintf(opts + off, sizeof opts - off, ",upperdir=/rw/upper,workdir=/rw/work");
    mkdir("/root", 0755);
    if (mount("dsec-rootfs", "/root", "overlay", 0, opts) < 0) return -1;
    /* The platform's tools (a session's bash, the host's top layer) as a container has them:
     * a read-only bind nothing inside can replace or remove (no CAP_SYS_ADMIN; the filter
     * refuses mount and umount), so no write to the overlay reaches them. */
    if (mount("/root/.dsec-tools", "/root/.dsec-tools", NULL, MS_BIND, NULL) == 0) {
        if (mount(NULL, "/root/.dsec-tools", NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
            return -1;
    } else if (errno != ENOENT) {
        return -1;
    }
    /* what the container backend mounts, the same way */
    mkdir("/root/proc", 0555);
    mkdir("/root/dev", 0755);
    mkdir("/root/sys", 0555);
    mkdir("/root/tmp", 01777);
    if (mount("proc", "/root/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) return -1;
    if (mount("sysfs", "/root/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, NULL) < 0) return -1;
    if (mount("tmpfs", "/root/dev", "tmpfs", MS_NOSUID | MS_STRICTATIME, "mode=755,size=65536k") < 0) return -1;
    for (size_t i = 0; i < sizeof devices / sizeof devices[0]; i++) {
        snprintf(dir, sizeof dir, "/root/dev/%s", devices[i].name);
        if (mknod(dir, S_IFCHR | 0666, makedev(devices[i].major, devices[i].minor)) < 0) return -1;
        chmod(dir, 0666);
    }
    mkdir("/root/dev/pts", 0755);
    mkdir("/root/dev/shm", 01777);
    if (mount("devpts", "/root/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") < 0) return -1;
    if (symlink("pts/ptmx", "/root/dev/ptmx") < 0) return -1;
    if (mount("shm", "/root/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=1777,size=65536k") < 0) return -1;
    symlink("/proc/self/fd", "/root/dev/fd");
    symlink("/proc/self/fd/0", "/root/dev/stdin");
    symlink("/proc/self/fd/1", "/root/dev/stdout");
    symlink("/proc/self/fd/2", "/root/dev/stderr");
    return 0;
}

/* The guest cgroups: a detached mount only this process holds (by fd); every exec gets a
 * child of "u", which holds the sandbox's process limit. */
static int setup_cgroups(void) {
    mkdir("/cg", 0700);
    if (mount("cgroup2", "/cg", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) return -1;
    int root = open("/cg", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) return -1;
    write_file(root, "cgroup.subtree_control", "+pids +memory");
    if (mkdirat(root, "u", 0700) < 0 && errno != EEXIST) return -1;
    char lim[32];
    snprintf(lim, sizeof lim, "%u", user_pids);
    write_file(root, "u/pids.max", lim);
    if (user_memory) {
        snprintf(lim, sizeof lim, "%llu", (unsigned long long)user_memory);
        write_file(root, "u/memory.max", lim);
        write_file(root, "u/memory.swap.max", "0");
    }
    write_file(root, "u/cgroup.subtree_control", "+pids +memory");
    cgroot = openat(root, "u", O_PATH | O_DIRECTORY | O_CLOEXEC);
    close(root);
    umount2("/cg", MNT_DETACH);
    rmdir("/cg");
    return cgroot < 0 ? -1 : 0;
}

/* What a container's runtime does to its /proc and /sys (dsec.isolation.spec): masked paths
 * (a file: /dev/null over it; a directory: an empty read-only tmpfs), read-only paths (a
 * read-only bind of themselves). Paths this kernel lacks are skipped. Nothing inside can
 * undo them: no CAP_SYS_ADMIN, and the filter refuses mount and umount. */
static int protect_paths(const char *root, const char *masked, int nmasked, const char *readonly, int nreadonly) {
    char path[4200], null[64];
    snprintf(null, sizeof null, "%s/dev/null", root);
    for (int i = 0; i < nmasked; i++, masked += strlen(masked) + 1) {
        struct stat st;
        snprintf(path, sizeof path, "%s%s", root, masked);
        if (lstat(path, &st) < 0) continue;
        unsigned long ro = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC;
        int rc = S_ISDIR(st.st_mode) ? mount("dsec-masked", path, "tmpfs", ro, "size=0")
                                     : mount(null, path, NULL, MS_BIND, NULL);
        if (rc == 0 && !S_ISDIR(st.st_mode)) rc = mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | ro, NULL);
        if (rc < 0 && errno != ENOENT) return -1;
    }
    for (int i = 0; i < nreadonly; i++, readonly += strlen(readonly) + 1) {
        snprintf(path, sizeof path, "%s%s", root, readonly);
        if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) < 0) {
            if (errno == ENOENT) continue;
            return -1;
        }
        if (mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) return -1;
    }
    return 0;
}

/* Each exec level's /proc, masked as the sandbox's is (dsec-levels.h). */
static int level_proc(void) {
    return protect_paths("", ns_masked, ns_nmasked, ns_readonly, ns_nreadonly) < 0 ? errno : 0;
}

/* Fresh entropy and the clock from the host: u32 seed_len, seed, i64 sec, i64 nsec. A
 * template's clones (and a checkpoint's restores) share its random state: reseed before
 * anything. Returns the bytes taken, or -errno. */
static int take_entropy_and_clock(const char *buf, uint32_t len) {
    uint32_t seed_len;
    int64_t sec, nsec;
    if (len < 4) return -EINVAL;
    memcpy(&seed_len, buf, 4);
    if (seed_len > 512 || len < 4 + seed_len + 16) return -EINVAL;
    const char *p = buf + 4;
    struct { int entropy_count, buf_size; unsigned char buf[512]; } ent;
    ent.entropy_count = (int)seed_len * 8;
    ent.buf_size = (int)seed_len;
    memcpy(ent.buf, p, seed_len);
    int rnd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    if (rnd < 0 || ioctl(rnd, RNDADDENTROPY, &ent) < 0 || ioctl(rnd, RNDRESEEDCRNG) < 0) {
        int e = errno ? errno : EIO;
        if (rnd >= 0) close(rnd);
        return -e;
    }
    close(rnd);
    p += seed_len;
    memcpy(&sec, p, 8);
    memcpy(&nsec, p + 8, 8);
    struct timespec ts = {.tv_sec = sec, .tv_nsec = nsec};
    if (clock_settime(CLOCK_REALTIME, &ts) < 0) return -errno;
    return (int)(4 + seed_len + 16);
}

static int handle_setup(const char *buf, uint32_t len) {
    uint32_t pids;
    int taken = take_entropy_and_clock(buf, len);
    if (taken < 0) return -taken;
    if (len < (uint32_t)taken + 1 + 4) return EINVAL;
    const char *p = buf + taken;
    int nlower = (unsigned char)*p++;
    memcpy(&pids, p, 4);
    p += 4;
    user_pids = pids;
    const char *end = buf + len, *strs[3];
    for (int i = 0; i < 3; i++) {
        const char *z = memchr(p, 0, end - p);
        if (!z) return EINVAL;
        strs[i] = p;
        p = z + 1;
    }
    /* then (optional, all or none): u32 filter length, the filter (struct sock_filter[]),
     * u16 count + NUL-terminated masked paths, u16 count + read-only paths, u64 the memory
     * of the sandbox's processes (their guest cgroup's memory.max) */
    const char *masked = NULL, *readonly = NULL;
    uint16_t nmasked = 0, nreadonly = 0;
    if (p < end) {
        uint32_t flen;
        if (end - p < 4) return EINVAL;
        memcpy(&flen, p, 4);
        p += 4;
        if (flen % sizeof(struct sock_filter) || flen / sizeof(struct sock_filter) > BPF_MAXINSNS ||
            (size_t)(end - p) < flen)
            return EINVAL;
        if (flen) {
            struct sock_filter *f = malloc(flen);
            if (!f) return ENOMEM;
            memcpy(f, p, flen);
            user_filter.filter = f;
            user_filter.len = (unsigned short)(flen / sizeof(struct sock_filter));
        }
        p += flen;
        const char **lists[2] = {&masked, &readonly};
        uint16_t *counts[2] = {&nmasked, &nreadonly};
        for (int l = 0; l < 2; l++) {
            if (end - p < 2) return EINVAL;
            memcpy(counts[l], p, 2);
            p += 2;
            *lists[l] = p;
            for (int i = 0; i < *counts[l]; i++) {
                const char *z = memchr(p, 0, end - p);
                if (!z || p[0] != '/') return EINVAL;
                p = z + 1;
            }
        }
        if (end - p >= 8) {
            memcpy(&user_memory, p, 8);
            p += 8;
        }
    }
    if (nlower < 1 || nlower > 25) return EINVAL;
    if (sethostname(strs[0], strlen(strs[0])) < 0) return errno;
    /* Allocations fail as in a container (the cgroup's OOM killer, not a refused mmap): the
     * guest is small, its processes' cgroup holds the limit. */
    write_file(AT_FDCWD, "/proc/sys/vm/overcommit_memory", "1");
    /* No process may attach to another, even of its own uid: /proc/<pid>/mem of a later exec
     * (a background process rewriting a grader's memory) needs ptrace's attach check, which
     * Yama's scope 3 refuses to everyone, for good (seccomp already denies ptrace itself). */
    if (write_file(AT_FDCWD, "/proc/sys/kernel/yama/ptrace_scope", "3") < 0) return errno ? errno : EIO;
    /* The network as a container's namespace has it (netpolicy's _sandbox_sysctls): IPv4 only,
     * ICMP echo sockets for processes without CAP_NET_RAW. */
    write_file(AT_FDCWD, "/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "1");
    write_file(AT_FDCWD, "/proc/sys/net/ipv6/conf/default/disable_ipv6", "1");
    write_file(AT_FDCWD, "/proc/sys/net/ipv4/ping_group_range", "0 2147483647");
    if (lo_up() < 0) return errno;
    if (strs[1][0] && set_address("eth0", strs[1], strs[2]) < 0) return errno;
    if (setup_cgroups() < 0) return errno;
    if (mount_root(nlower) < 0) return errno;
    rwfd = open("/rw", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (protect_paths("/root", masked, nmasked, readonly, nreadonly) < 0) return errno;
    if (ns_keep_proc_paths(masked, nmasked, readonly, nreadonly) < 0) return ENOMEM;
    /* Leave the initramfs: nothing of it stays reachable (its files are gone, /dev /proc
     * /sys of the agent are detached), then the overlay becomes "/". */
    unlink("/init");
    umount2("/proc", MNT_DETACH);
    umount2("/sys", MNT_DETACH);
    umount2("/dev", MNT_DETACH);
    if (chdir("/root") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 || chdir("/") < 0)
        return errno;
    return 0;
}

/* A VM restored from a memory checkpoint ('Z'): fresh entropy, the clock, its new name.
 * What ran for the old host keeps running but loses its stdio, whose reader is gone. */
static int handle_resumed(const char *buf, uint32_t len) {
    int taken = take_entropy_and_clock(buf, len);
    if (taken < 0) return -taken;
    const char *name = buf + taken, *z = memchr(name, 0, len - (uint32_t)taken);
    if (!z) return EINVAL;
    if (sethostname(name, (size_t)(z - name)) < 0) return errno;
    for (int i = 0; i < MAX_PROCS; i++) {
        struct proc *p = &procs[i];
        if (!p->pid) continue;
        close_fd(&p->in);
        close_fd(&p->out);
        close_fd(&p->err);
        free(p->inbuf);
        memset(p, 0, sizeof *p); /* (its cgroup stays until it is empty) */
        p->in = p->out = p->err = -1;
    }
    outlen = outoff = 0; /* frames for the old host */
    return 0;
}

/* Every sandbox process ('U'): what a restore into the sandbox or a verifier needs gone. */
static int kill_all(void) {
    if (cgroot < 0) return ENODEV;
    return write_file(cgroot, "cgroup.kill", "1") < 0 ? errno : 0;
}
