/*
 * dsec-archiver.h: the microVM guest agent's own archiver (inlined into dsec-guest.c by the
 * build, after dsec-child.h). A child of the agent writes a tar on its stdout: the writable
 * layer as an OCI layer (a snapshot), or one tree of the sandbox's own view (a trusted
 * exec's copy of a task directory, protect()). No program of the image runs: the agent's
 * root may have replaced them all. Uses the agent's rwfd.
 */

/* --- the writable layer as a tar (a snapshot) ---------------------------------------------
 * The overlay's upper directory on the writable disk, as an OCI layer: directories, regular
 * files, symlinks and FIFOs with their modes, owners and times; a whiteout (the character
 * device 0:0 overlayfs leaves for a deleted lower file) as an empty ".wh.NAME", an opaque
 * directory as an empty ".wh..wh..opq" in it; hard links as links to the first name met
 * (the first HL_MAX files with several names; further ones as copies); other device nodes
 * and sockets are left out. POSIX pax records carry long names and large numbers. The host
 * trusts nothing of it: it unpacks it as it unpacks any tarball (dsec.layers.builders.tar),
 * into a layer of its store. Runs in a child of the agent (root, outside the sandbox's
 * cgroup, non-dumpable), while the host holds the disk's writers (FIFREEZE). */

static char tbuf[65536];
static size_t tlen;

static int tar_flush(void) {
    size_t off = 0;
    while (off < tlen) {
        ssize_t n = write(1, tbuf + off, tlen - off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return errno ? errno : EIO;
        off += (size_t)n;
    }
    tlen = 0;
    return 0;
}

static int tar_put(const void *data, size_t n) {
    const char *c = data;
    while (n) {
        size_t k = sizeof tbuf - tlen < n ? sizeof tbuf - tlen : n;
        memcpy(tbuf + tlen, c, k);
        tlen += k;
        c += k;
        n -= k;
        if (tlen == sizeof tbuf) {
            int e = tar_flush();
            if (e) return e;
        }
    }
    return 0;
}

static int tar_pad(uint64_t size) {
    static const char zero[512];
    size_t r = (size_t)(size % 512);
    return r ? tar_put(zero, 512 - r) : 0;
}

/* One pax record, "LEN key=value\n", LEN counting itself; 0 if it does not fit. */
static size_t pax_record(char *out, size_t room, const char *key, const char *value) {
    size_t body = strlen(key) + strlen(value) + 3, len = body + 1;
    while ((size_t)snprintf(NULL, 0, "%zu", len) + body != len) len++;
    if (len >= room) return 0;
    snprintf(out, room, "%zu %s=%s\n", len, key, value);
    return len;
}

static void tar_octal(char *field, int width, uint64_t v) {
    snprintf(field, (size_t)width, "%0*llo", width - 1, (unsigned long long)v);
}

static int tar_block(const char *name, char type, uint64_t mode, uint64_t uid, uint64_t gid, uint64_t size,
                     uint64_t mtime, const char *link) {
    char h[512];
    memset(h, 0, sizeof h);
    memcpy(h, name, strnlen(name, 100));
    tar_octal(h + 100, 8, mode & 07777);
    tar_octal(h + 108, 8, uid > 07777777 ? 0 : uid);
    tar_octal(h + 116, 8, gid > 07777777 ? 0 : gid);
    tar_octal(h + 124, 12, size > 077777777777ULL ? 0 : size);
    tar_octal(h + 136, 12, mtime > 077777777777ULL ? 077777777777ULL : mtime);
    memset(h + 148, ' ', 8);
    h[156] = type;
    if (link) memcpy(h + 157, link, strnlen(link, 100));
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    unsigned sum = 0;
    for (int i = 0; i < 512; i++) sum += (unsigned char)h[i];
    snprintf(h + 148, 8, "%06o", sum);
    h[155] = ' ';
    return tar_put(h, sizeof h);
}

static int tar_header(const char *path, char type, const struct stat *st, uint64_t size, const char *link) {
    static char pax[2 * 4096 + 256];
    char num[32];
    size_t plen = 0;
    uint64_t uid = st->st_uid, gid = st->st_gid;
    if (strlen(path) > 99) plen += pax_record(pax + plen, sizeof pax - plen, "path", path);
    if (link && strlen(link) > 99) plen += pax_record(pax + plen, sizeof pax - plen, "linkpath", link);
    if (uid > 07777777) {
        snprintf(num, sizeof num, "%llu", (unsigned long long)uid);
        plen += pax_record(pax + plen, sizeof pax - plen, "uid", num);
    }
    if (gid > 07777777) {
        snprintf(num, sizeof num, "%llu", (unsigned long long)gid);
        plen += pax_record(pax + plen, sizeof pax - plen, "gid", num);
    }
    if (size > 077777777777ULL) {
        snprintf(num, sizeof num, "%llu", (unsigned long long)size);
        plen += pax_record(pax + plen, sizeof pax - plen, "size", num);
    }
    int e;
    if (plen && ((e = tar_block("././@PaxHeader", 'x', 0644, 0, 0, plen, 0, NULL)) || (e = tar_put(pax, plen)) ||
                 (e = tar_pad(plen))))
        return e;
    uint64_t mtime = st->st_mtim.tv_sec < 0 ? 0 : (uint64_t)st->st_mtim.tv_sec;
    return tar_block(path, type, st->st_mode, uid, gid, size, mtime, link);
}

static int tar_file(int dfd, const char *name, const char *path) {
    int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return errno;
    struct stat st;
    int e = fstat(fd, &st) < 0 ? errno : 0;
    if (!e && !S_ISREG(st.st_mode)) e = EAGAIN; /* changed under us: the disk is held, so never */
    if (!e) e = tar_header(path, '0', &st, (uint64_t)st.st_size, NULL);
    uint64_t left = e ? 0 : (uint64_t)st.st_size;
    while (!e && left) {
        if (tlen == sizeof tbuf && (e = tar_flush())) break;
        size_t want = sizeof tbuf - tlen < left ? sizeof tbuf - tlen : (size_t)left;
        ssize_t n = read(fd, tbuf + tlen, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { e = errno; break; }
        if (n == 0) { /* shorter than it said: the rest as zeros, the size as announced */
            memset(tbuf + tlen, 0, want);
            n = (ssize_t)want;
        }
        tlen += (size_t)n;
        left -= (uint64_t)n;
    }
    if (!e) e = tar_pad((uint64_t)st.st_size);
    close(fd);
    return e;
}

/* Files with several names met so far: (inode, first name), open addressing. */
#define HL_SLOTS 131072
#define HL_MAX 65536
static struct hl { uint64_t ino; char *path; } *hl;
static size_t hl_used;

static int hl_off; /* a tree of the merged view (several file systems: inode numbers may repeat) */

static const char *hl_first(uint64_t ino, const char *path) {
    if (hl_off) return NULL;
    if (!hl && !(hl = calloc(HL_SLOTS, sizeof *hl))) return NULL;
    size_t i = (size_t)(ino * 0x9E3779B97F4A7C15ULL) & (HL_SLOTS - 1);
    for (; hl[i].path; i = (i + 1) & (HL_SLOTS - 1))
        if (hl[i].ino == ino) return hl[i].path;
    if (hl_used < HL_MAX && (hl[i].path = strdup(path)) != NULL) {
        hl[i].ino = ino;
        hl_used++;
    }
    return NULL;
}

static int tar_tree(int dfd, char *path, size_t plen, int depth);

static int tar_entry(int dfd, const char *name, char *path, size_t plen, int depth) {
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) return errno == ENOENT ? 0 : errno;
    if (S_ISREG(st.st_mode) && st.st_nlink > 1) { /* (one file system: the inode names it) */
        const char *first = hl_first((uint64_t)st.st_ino, path);
        if (first) return tar_header(path, '1', &st, 0, first);
    }
    if (S_ISREG(st.st_mode)) return tar_file(dfd, name, path);
    if (S_ISLNK(st.st_mode)) {
        static char target[4097];
        ssize_t n = readlinkat(dfd, name, target, sizeof target - 1);
        if (n < 0) return errno;
        target[n] = 0;
        return tar_header(path, '2', &st, 0, target);
    }
    if (S_ISFIFO(st.st_mode)) return tar_header(path, '6', &st, 0, NULL);
    if (S_ISCHR(st.st_mode) && st.st_rdev == 0) { /* a whiteout: ".wh.NAME" beside it */
        static char wh[4400];
        size_t dir = plen - strlen(name);
        snprintf(wh, sizeof wh, "%.*s.wh.%s", (int)dir, path, name);
        struct stat none = {.st_mode = S_IFREG, .st_mtim = st.st_mtim};
        return tar_header(wh, '0', &none, 0, NULL);
    }
    if (!S_ISDIR(st.st_mode)) return 0; /* devices, sockets: not part of a layer */
    if (depth > 512) return ELOOP;
    int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return errno;
    int e = tar_header(path, '5', &st, 0, NULL);
    char opq[2];
    if (!e && fgetxattr(fd, "trusted.overlay.opaque", opq, sizeof opq) == 1 && opq[0] == 'y') {
        static char wh[4400];
        snprintf(wh, sizeof wh, "%s/.wh..wh..opq", path);
        struct stat none = {.st_mode = S_IFREG, .st_mtim = st.st_mtim};
        e = tar_header(wh, '0', &none, 0, NULL);
    }
    if (e) {
        close(fd);
        return e;
    }
    return tar_tree(fd, path, plen, depth + 1);
}

/* Every entry of the directory `dfd` (closed here), named below `path` (plen bytes). */
static int tar_tree(int dfd, char *path, size_t plen, int depth) {
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return errno;
    }
    int e = 0;
    for (;;) {
        errno = 0;
        struct dirent *ent = readdir(d);
        if (!ent) {
            e = errno;
            break;
        }
        const char *n = ent->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
        size_t nl = strlen(n), at = plen ? plen + 1 : 0;
        if (at + nl >= 4096) {
            e = ENAMETOOLONG;
            break;
        }
        if (plen) path[plen] = '/';
        memcpy(path + at, n, nl + 1);
        e = tar_entry(dirfd(d), n, path, at + nl, depth);
        path[plen] = 0;
        if (e) break;
    }
    closedir(d);
    return e;
}

/* `path` of the sandbox's own view (its root is ours since the chroot) as one tar: a
 * directory's contents ("." first: its mode and owner), or one file or link (its name); no
 * link is followed on the way (openat2 refuses them: a task directory that is a link is
 * "not there", as on the container backend). A trusted exec's copy of a task directory or
 * protect() of a path, without a program of the image (which the agent may have replaced). */
static int tar_path(const char *path) {
    const char *slash = strrchr(path, '/');
    if (path[0] != '/' || !slash || !slash[1] || strlen(path) > 4000) return EINVAL;
    static char parent[4097], name[4097];
    snprintf(parent, sizeof parent, "%.*s", (int)(slash - path) ? (int)(slash - path) : 1, path);
    snprintf(name, sizeof name, "%s", slash + 1);
    struct { uint64_t flags, mode, resolve; } how = {O_PATH | O_DIRECTORY | O_CLOEXEC, 0, 0x02 | 0x04 | 0x01};
    /* RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV */
    int pfd = (int)syscall(437 /* openat2 */, AT_FDCWD, parent, &how, sizeof how);
    if (pfd < 0) return errno;
    hl_off = 1;
    struct stat st;
    int e = fstatat(pfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 ? errno : 0;
    if (!e && S_ISDIR(st.st_mode)) {
        int fd = openat(pfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        static char rel[4200];
        rel[0] = 0;
        if (fd < 0) e = errno;
        else if (!(e = tar_header(".", '5', &st, 0, NULL))) e = tar_tree(fd, rel, 0, 0);
        else close(fd);
    } else if (!e) {
        static char rel[4200];
        snprintf(rel, sizeof rel, "%s", name);
        e = tar_entry(pfd, name, rel, strlen(rel), 0);
    }
    close(pfd);
    return e;
}

/* The archiver child: stdout the tar, nothing else open but the upper directory (or, given
 * a path, the tree there: tar_path). */
static void child_archive(int errfd, int pout, int perr, const char *tree) {
    int err = 0;
    child_reset_signals();
    setsid();
    int up = rwfd < 0 ? -1 : openat(rwfd, "upper", O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (up < 0) err = rwfd < 0 ? ENODEV : errno;
    if (!err && tree) { /* (its errors come with the exit status: the tar may have begun) */
        if (dup2(pout, 1) < 0 || dup2(perr, 2) < 0) err = errno;
        if (!err && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) err = errno;
        if (!err) err = child_own_domain();
        if (err) {
            (void)!write(errfd, &err, sizeof err);
            _exit(127);
        }
        syscall(SYS_close_range, 3, ~0U, 0);
        static const char end[1024];
        err = tar_path(tree);
        if (!err) err = tar_put(end, sizeof end);
        if (!err) err = tar_flush();
        _exit(err & 0xff ? err & 0xff : (err ? EIO : 0));
    }
    if (!err && (dup2(pout, 1) < 0 || dup2(perr, 2) < 0)) err = errno;
    if (!err && up < 3) err = EBADF; /* (0-2 are always open in the agent) */
    if (!err && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) err = errno;
    if (!err) err = child_own_domain(); /* nothing of the sandbox can ptrace-access it */
    if (err) {
        (void)!write(errfd, &err, sizeof err);
        _exit(127);
    }
    syscall(SYS_close_range, 3, up - 1, 0); /* the error pipe too: the parent reads "started" */
    syscall(SYS_close_range, up + 1, ~0U, 0);
    static char path[4200];
    path[0] = 0;
    static const char end[1024];
    err = tar_tree(up, path, 0, 0);
    if (!err) err = tar_put(end, sizeof end);
    if (!err) err = tar_flush();
    _exit(err & 0xff ? err & 0xff : (err ? EIO : 0));
}
