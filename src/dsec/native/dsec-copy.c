/*
 * dsec-copy: copy a writable layer exactly, fast, on the host.
 *
 *   dsec-copy [-j THREADS] [-n] [-s FD] [-u FROM:TO:COUNT] SRC DST
 *
 * Copies the tree under SRC into DST (created if missing): regular files
 * (sparse files stay sparse), directories, symlinks, device nodes (overlayfs
 * whiteouts are 0/0 character devices), fifos and sockets, with owners, modes,
 * timestamps, extended attributes (overlayfs keeps opaque and redirect markers
 * in trusted.overlay.*) and hard links. With -n, entries that already exist in
 * DST are kept (used to merge a lower layer under an upper copy). With -s FD,
 * one byte is written to FD (then closed) as soon as every directory exists in
 * DST, before file contents are copied: a fork starts its children then (see
 * edge.fork for why that is safe). With -u, owners are shifted: ids FROM..FROM+COUNT-1
 * become TO..TO+COUNT-1 (a sandbox's writable layer, owned by its own host id range,
 * copied into the layer store's canonical range); an id outside it becomes TO+65534
 * (nobody): a layer never keeps a host id it was not meant to have.
 *
 * Why not `cp -a`: forks copy the writable layer of a frozen sandbox on the
 * critical path. cp copies one file at a time with ~15 system calls each; this
 * walks the tree once, then copies with THREADS workers, largest files first
 * (data in-kernel with copy_file_range or sendfile, very large files split
 * into chunks), with ~9 system calls per small file.
 *
 * SRC is content written by a sandbox, so it is hostile: nothing is ever
 * followed. Every source path is opened with openat2(RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV) relative to
 * SRC, every stat is AT_SYMLINK_NOFOLLOW, and symlinks are recreated, never
 * resolved. DST is created by us and written only by us.
 *
 * Exit status: 0 on success, 1 on any failure (a message on stderr names the
 * path), 2 on bad usage.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

/* Files larger than this are copied in chunks of it, by several workers. Writes to one file
 * serialize on its inode lock (tmpfs), so chunks only pay when files are really large. */
#define CHUNK (256L << 20)

struct entry {
    char *path;   /* relative to SRC and DST; "." is the root */
    struct stat st;
    int link_to;  /* >= 0: a hard link to entries[link_to] (regular files) */
    int skip;     /* -n and DST already has it */
};

struct work {
    int entry;
    off_t off, len; /* len < 0: the whole file, created by the worker */
};

static struct entry *entries;
static size_t n_entries, cap_entries;
static struct work *works;
static size_t n_works, cap_works;
static int src_fd, dst_fd, no_clobber;
static long shift_from = -1, shift_to, shift_count; /* -u */
static atomic_size_t next_work;
static atomic_int failed;

static void fail(const char *what, const char *path) {
    fprintf(stderr, "dsec-copy: %s %s: %s\n", what, path, strerror(errno));
    atomic_store(&failed, 1);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n);
    if (!q) {
        perror("dsec-copy: out of memory");
        exit(1);
    }
    return q;
}

static int open_src(const char *path, int flags) {
    struct open_how how = {
        .flags = (uint64_t)(flags | O_CLOEXEC | O_NOFOLLOW),
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV,
    };
    return (int)syscall(SYS_openat2, src_fd, path, &how, sizeof how);
}

static int add_entry(const char *path, const struct stat *st) {
    if (n_entries == cap_entries) {
        cap_entries = cap_entries ? cap_entries * 2 : 1024;
        entries = xrealloc(entries, cap_entries * sizeof *entries);
    }
    struct entry *e = &entries[n_entries];
    e->path = strdup(path);
    e->st = *st;
    if (shift_from >= 0) {
        uid_t u = st->st_uid;
        gid_t g = st->st_gid;
        e->st.st_uid = (uid_t)(u >= shift_from && u < shift_from + shift_count ? u - shift_from + shift_to : shift_to + 65534);
        e->st.st_gid = (gid_t)(g >= shift_from && g < shift_from + shift_count ? g - shift_from + shift_to : shift_to + 65534);
    }
    e->link_to = -1;
    e->skip = 0;
    return (int)n_entries++;
}

static void add_work(int entry, off_t off, off_t len) {
    if (n_works == cap_works) {
        cap_works = cap_works ? cap_works * 2 : 1024;
        works = xrealloc(works, cap_works * sizeof *works);
    }
    works[n_works++] = (struct work){entry, off, len};
}

/* Hard links: (dev, ino) of files with st_nlink > 1 -> their first entry (open addressing). */
struct ino_key { dev_t dev; ino_t ino; int entry; };
static struct ino_key *inos;
static size_t n_inos, cap_inos; /* cap_inos: a power of two */

static size_t ino_slot(dev_t dev, ino_t ino) {
    uint64_t h = ((uint64_t)ino * 0x9E3779B97F4A7C15ull) ^ (uint64_t)dev;
    size_t i = (size_t)(h >> 17) & (cap_inos - 1);
    while (inos[i].entry >= 0 && !(inos[i].dev == dev && inos[i].ino == ino)) i = (i + 1) & (cap_inos - 1);
    return i;
}

/* The first entry with this inode, or -1 after recording `entry` as the first. */
static int first_link(const struct stat *st, int entry) {
    if (2 * (n_inos + 1) > cap_inos) {
        struct ino_key *old = inos;
        size_t old_cap = cap_inos;
        cap_inos = cap_inos ? cap_inos * 2 : 256;
        inos = xrealloc(NULL, cap_inos * sizeof *inos);
        for (size_t i = 0; i < cap_inos; i++) inos[i].entry = -1;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].entry >= 0) inos[ino_slot(old[i].dev, old[i].ino)] = old[i];
        free(old);
    }
    size_t i = ino_slot(st->st_dev, st->st_ino);
    if (inos[i].entry >= 0) return inos[i].entry;
    inos[i] = (struct ino_key){st->st_dev, st->st_ino, entry};
    n_inos++;
    return -1;
}

/* The type of PATH in DST, 0 when absent; never follows a link. Every parent of a path
 * looked up or created in DST is a directory walk() created or found as one, so no path
 * of DST resolves through a symlink (see walk). */
static mode_t dst_type(const char *path) {
    struct stat st;
    return fstatat(dst_fd, path, &st, AT_SYMLINK_NOFOLLOW) == 0 ? (st.st_mode & S_IFMT) : 0;
}

/* An overlayfs opaque directory in DST (everything below it in lower layers is hidden). */
static int is_opaque(const char *path) {
    int fd = openat(dst_fd, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return 0;
    char v[4];
    ssize_t n = fgetxattr(fd, "trusted.overlay.opaque", v, sizeof v);
    close(fd);
    return n == 1 && v[0] == 'y';
}

/* Phase 1: walk SRC (single thread), create every directory in DST. */
static int walk(const char *rel) {
    int dfd = open_src(rel, O_RDONLY | O_DIRECTORY);
    if (dfd < 0) {
        fail("open directory", rel);
        return -1;
    }
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        fail("read directory", rel);
        return -1;
    }
    struct dirent *de;
    char *path = xrealloc(NULL, PATH_MAX); /* on the heap: the recursion is as deep as the tree */
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (strcmp(rel, ".") == 0) snprintf(path, PATH_MAX, "%s", de->d_name);
        else if (snprintf(path, PATH_MAX, "%s/%s", rel, de->d_name) >= PATH_MAX) {
            errno = ENAMETOOLONG;
            fail("path", rel);
            continue;
        }
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            fail("stat", path);
            continue;
        }
        mode_t existing = no_clobber ? dst_type(path) : 0;
        int skip = existing != 0;
        if (S_ISDIR(st.st_mode)) {
            int i = add_entry(path, &st);
            if (!skip && mkdirat(dst_fd, path, 0700) < 0 && errno != EEXIST) fail("mkdir", path);
            /* Owned as in the end right away: a fork's children are started once every
             * directory exists, and an idmapped mount of this tree lets even root through a
             * 0700 directory only when its owner is an id of the mount's range. */
            if (!skip && fchownat(dst_fd, path, entries[i].st.st_uid, entries[i].st.st_gid, AT_SYMLINK_NOFOLLOW) < 0)
                fail("chown", path);
            entries[i].skip = skip; /* an existing directory: merge into it, keep its metadata */
            /* What DST already has there hides this directory whole unless it is a directory
             * that is not opaque (overlayfs). Above all, a symlink there (a sandbox's, from
             * its writable layer) is never walked through: it would take every entry below
             * it out of DST, onto the host. */
            if (!skip || (S_ISDIR(existing) && !is_opaque(path))) walk(entries[i].path);
            continue;
        }
        int i = add_entry(path, &st);
        entries[i].skip = skip;
        if (skip) continue;
        if (S_ISREG(st.st_mode)) {
            if (st.st_nlink > 1) {
                int first = first_link(&st, i);
                if (first >= 0) {
                    entries[i].link_to = first;
                    continue;
                }
            }
            if (st.st_size > CHUNK) {
                /* Created here, filled by chunks in parallel. */
                int fd = openat(dst_fd, path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, st.st_mode & 0777);
                if (fd < 0 || ftruncate(fd, st.st_size) < 0) fail("create", path);
                if (fd >= 0) close(fd);
                for (off_t off = 0; off < st.st_size; off += CHUNK)
                    add_work(i, off, st.st_size - off < CHUNK ? st.st_size - off : CHUNK);
            } else {
                add_work(i, 0, -1);
            }
        } else {
            add_work(i, 0, -1); /* symlinks, devices, fifos, sockets */
        }
    }
    free(path);
    closedir(d);
    return 0;
}

/* Copy len bytes at off from in to out at the same offset (out's file position is at off).
 * copy_file_range stays in the kernel; across file systems (a sandbox's tmpfs to the fork
 * store) it says EXDEV once, and from then on sendfile (also in-kernel) does it directly. */
static atomic_int cross_fs;

static int xfer(int in, int out, off_t off, off_t len) {
    loff_t i = off, o = off;
    off_t end = off + len;
    while (i < end && !atomic_load_explicit(&cross_fs, memory_order_relaxed)) {
        ssize_t n = copy_file_range(in, &i, out, &o, (size_t)(end - i), 0);
        if (n > 0) continue;
        if (n == 0) return 0; /* the source shrank: it is frozen, so this does not happen */
        if (errno != EXDEV && errno != EINVAL && errno != EOPNOTSUPP && errno != ENOSYS) return -1;
        atomic_store(&cross_fs, 1);
        if (lseek(out, i, SEEK_SET) < 0) return -1;
    }
    while (i < end) {
        off_t pos = i;
        size_t want = (size_t)(end - i) > (1u << 30) ? (1u << 30) : (size_t)(end - i);
        ssize_t m = sendfile(out, in, &pos, want);
        if (m < 0) return -1;
        if (m == 0) return 0;
        i = pos;
    }
    return 0;
}

/* Copy [off, off+len) of src to dst at the same offsets, data extents only. */
static int copy_range(int in, int out, off_t off, off_t len) {
    off_t end = off + len;
    while (off < end) {
        off_t data = lseek(in, off, SEEK_DATA);
        if (data < 0) return errno == ENXIO ? 0 : -1; /* only a hole is left */
        if (data >= end) return 0;
        off_t hole = lseek(in, data, SEEK_HOLE);
        if (hole < 0) return -1;
        if (hole > end) hole = end;
        if (lseek(out, data, SEEK_SET) < 0 || xfer(in, out, data, hole - data) < 0) return -1;
        off = hole;
    }
    return 0;
}

/* Paths (when the fds are -1) are /proc/self/fd links of O_PATH handles, so they are followed. */
/* A whole file: dense ones in one go, sparse ones extent by extent (holes stay holes). */
static int copy_file(int in, int out, const struct stat *st) {
    if ((off_t)st->st_blocks * 512 >= st->st_size) return xfer(in, out, 0, st->st_size);
    if (copy_range(in, out, 0, st->st_size) < 0) return -1;
    return ftruncate(out, st->st_size);
}

static void copy_xattrs(int in_fd, const char *src_path, int out_fd, const char *dst_path) {
    char names[65536], value[65536];
    ssize_t n = in_fd >= 0 ? flistxattr(in_fd, names, sizeof names) : listxattr(src_path, names, sizeof names);
    if (n <= 0) return;
    for (char *k = names; k < names + n; k += strlen(k) + 1) {
        ssize_t v = in_fd >= 0 ? fgetxattr(in_fd, k, value, sizeof value) : getxattr(src_path, k, value, sizeof value);
        if (v < 0) continue;
        int r = out_fd >= 0 ? fsetxattr(out_fd, k, value, (size_t)v, 0) : setxattr(dst_path, k, value, (size_t)v, 0);
        if (r < 0 && errno != ENOTSUP) fail("set xattr on", dst_path);
    }
}

/* Files are created with their final permission bits (umask 0); chown clears set-id bits,
 * so only those need a chmod afterwards. Directories are created 0700 and always need it. */
static void set_meta_fd(int fd, const struct entry *e) {
    if (fchown(fd, e->st.st_uid, e->st.st_gid) < 0) fail("chown", e->path);
    if ((S_ISDIR(e->st.st_mode) || (e->st.st_mode & 07000)) && fchmod(fd, e->st.st_mode & 07777) < 0)
        fail("chmod", e->path);
    struct timespec ts[2] = {e->st.st_atim, e->st.st_mtim};
    if (futimens(fd, ts) < 0) fail("set times of", e->path);
}

static void copy_regular(const struct work *w) {
    const struct entry *e = &entries[w->entry];
    int in = open_src(e->path, O_RDONLY);
    if (in < 0) {
        fail("open", e->path);
        return;
    }
    int whole = w->len < 0;
    int out = whole ? openat(dst_fd, e->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, e->st.st_mode & 0777)
                    : openat(dst_fd, e->path, O_WRONLY | O_CLOEXEC);
    if (out < 0) {
        fail("create", e->path);
        close(in);
        return;
    }
    if (whole) {
        if (e->st.st_size > 0 && copy_file(in, out, &e->st) < 0) fail("copy", e->path);
        copy_xattrs(in, NULL, out, NULL);
        set_meta_fd(out, e);
    } else if (copy_range(in, out, w->off, w->len) < 0) {
        fail("copy", e->path);
    }
    close(in);
    close(out);
}

static void copy_special(const struct entry *e) {
    const struct stat *st = &e->st;
    char target[PATH_MAX];
    if (S_ISLNK(st->st_mode)) {
        int fd = open_src(e->path, O_PATH);
        ssize_t n = fd < 0 ? -1 : readlinkat(fd, "", target, sizeof target - 1);
        if (fd >= 0) close(fd);
        if (n < 0) {
            fail("read link", e->path);
            return;
        }
        target[n] = 0;
        if (symlinkat(target, dst_fd, e->path) < 0) {
            fail("symlink", e->path);
            return;
        }
    } else if (mknodat(dst_fd, e->path, st->st_mode & (S_IFMT | 07777), st->st_rdev) < 0) {
        fail("mknod", e->path);
        return;
    }
    if (fchownat(dst_fd, e->path, st->st_uid, st->st_gid, AT_SYMLINK_NOFOLLOW) < 0) fail("chown", e->path);
    if (!S_ISLNK(st->st_mode) && fchmodat(dst_fd, e->path, st->st_mode & 07777, 0) < 0) fail("chmod", e->path);
    /* xattrs on special files: through the O_PATH fds' /proc paths (no fgetxattr on O_PATH). */
    int in = open_src(e->path, O_PATH);
    int out = openat(dst_fd, e->path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (in >= 0 && out >= 0) {
        char sp[64], dp[64];
        snprintf(sp, sizeof sp, "/proc/self/fd/%d", in);
        snprintf(dp, sizeof dp, "/proc/self/fd/%d", out);
        if (!S_ISLNK(st->st_mode)) copy_xattrs(-1, sp, -1, dp);
    }
    if (in >= 0) close(in);
    if (out >= 0) close(out);
    struct timespec ts[2] = {st->st_atim, st->st_mtim};
    if (utimensat(dst_fd, e->path, ts, AT_SYMLINK_NOFOLLOW) < 0) fail("set times of", e->path);
}

/* Largest first: one worker takes the big files while the others take the many small ones. */
static int by_size_desc(const void *a, const void *b) {
    const struct work *x = a, *y = b;
    off_t sx = x->len >= 0 ? x->len : entries[x->entry].st.st_size;
    off_t sy = y->len >= 0 ? y->len : entries[y->entry].st.st_size;
    return sx < sy ? 1 : sx > sy ? -1 : 0;
}

static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        size_t i = atomic_fetch_add(&next_work, 1);
        if (i >= n_works) return NULL;
        const struct work *w = &works[i];
        const struct entry *e = &entries[w->entry];
        if (S_ISREG(e->st.st_mode)) copy_regular(w);
        else copy_special(e);
    }
}

/* Copy the xattrs and metadata of `e` from `in` to `out`, opened by the caller (a failed
 * open of either fails as `what`); close both. */
static void copy_meta_and_close(const struct entry *e, int in, int out, const char *what) {
    if (in >= 0 && out >= 0) {
        copy_xattrs(in, NULL, out, NULL);
        set_meta_fd(out, e);
    } else {
        fail(what, e->path);
    }
    if (in >= 0) close(in);
    if (out >= 0) close(out);
}

/* Phase 3: what needs all data in place: metadata of chunked files, hard links, directories. */
static void finish(void) {
    for (size_t i = 0; i < n_entries; i++) {
        const struct entry *e = &entries[i];
        if (e->skip || !S_ISREG(e->st.st_mode)) continue;
        if (e->link_to >= 0) {
            if (linkat(dst_fd, entries[e->link_to].path, dst_fd, e->path, 0) < 0) fail("link", e->path);
        } else if (e->st.st_size > CHUNK) {
            int in = open_src(e->path, O_RDONLY), out = openat(dst_fd, e->path, O_WRONLY | O_CLOEXEC);
            copy_meta_and_close(e, in, out, "reopen");
        }
    }
    /* Directories last, deepest first, so creating their entries does not change their times. */
    for (size_t k = n_entries; k-- > 0;) {
        const struct entry *e = &entries[k];
        if (e->skip || !S_ISDIR(e->st.st_mode)) continue;
        int in = open_src(e->path, O_RDONLY | O_DIRECTORY);
        int out = openat(dst_fd, e->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        copy_meta_and_close(e, in, out, "open directory");
    }
}

int main(int argc, char **argv) {
    int threads = 2, opt, signal_fd = -1;
    while ((opt = getopt(argc, argv, "j:ns:u:")) != -1) {
        if (opt == 'j') threads = atoi(optarg);
        else if (opt == 'n') no_clobber = 1;
        else if (opt == 's') signal_fd = atoi(optarg);
        else if (opt == 'u') {
            if (sscanf(optarg, "%ld:%ld:%ld", &shift_from, &shift_to, &shift_count) != 3 || shift_from < 0 ||
                shift_to < 0 || shift_count < 65535 || shift_from + shift_count > 4294967295L ||
                shift_to + shift_count > 4294967295L)
                goto usage;
        } else goto usage;
    }
    if (argc - optind != 2 || threads < 1 || threads > 64) goto usage;
    src_fd = open(argv[optind], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (src_fd < 0) {
        fail("open", argv[optind]);
        return 1;
    }
    if (mkdir(argv[optind + 1], 0700) < 0 && errno != EEXIST) {
        fail("mkdir", argv[optind + 1]);
        return 1;
    }
    dst_fd = open(argv[optind + 1], O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dst_fd < 0) {
        fail("open", argv[optind + 1]);
        return 1;
    }
    struct stat root;
    if (fstat(src_fd, &root) < 0) {
        fail("stat", argv[optind]);
        return 1;
    }
    int root_i = add_entry(".", &root);
    entries[root_i].skip = no_clobber; /* merging under an existing root keeps its metadata */
    if (!no_clobber && fchown(dst_fd, entries[root_i].st.st_uid, entries[root_i].st.st_gid) < 0) fail("chown", ".");
    umask(0);
    walk(".");
    qsort(works, n_works, sizeof *works, by_size_desc);
    if (atomic_load(&failed)) return 1;
    if (signal_fd >= 0) {
        if (write(signal_fd, "d", 1) != 1) fail("signal", "directories done");
        close(signal_fd);
    }
    pthread_t tids[64];
    int started = 0;
    for (int t = 1; t < threads && (size_t)t < n_works; t++)
        if (pthread_create(&tids[started], NULL, worker, NULL) == 0) started++;
    worker(NULL);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    if (atomic_load(&failed)) return 1;
    finish();
    return atomic_load(&failed) ? 1 : 0;
usage:
    fprintf(stderr, "usage: dsec-copy [-j THREADS] [-n] [-s FD] [-u FROM:TO:COUNT (COUNT >= 65535)] SRC DST\n");
    return 2;
}
