/*
 * dsec-trusted: run one platform command (verify, an exec marked trusted) in a
 * sandbox with a toolchain the sandbox cannot have changed.
 *
 *   dsec-trusted FD
 *
 * FD holds the options and the command, each string NUL-terminated (a sealed
 * memfd the edge wrote): the command, its environment and every host path travel
 * there, never in an argv or environ a process of the sandbox could read from
 * /proc (the child below is in the sandbox's pid namespace until it execs, and
 * the edge starts this program with an empty environment). The options:
 *
 *   --status FD           where the result goes: "X <wait status>\n", or
 *                         "E <message>\n" when the command could not be set up
 *   --ns TYPE FD          the sandbox's namespaces (mnt pid net ipc uts cgroup)
 *   --root FD             O_PATH on the sandbox's root (/proc/<init>/root)
 *   --cgroup FD           a cgroup.procs to join (repeat: every hierarchy)
 *   --scratch DIR         an empty host directory for the private mounts
 *   --lower DIR           an image layer (repeat, top first)
 *   --task PATH           a task directory, taken live from the sandbox (repeat)
 *   --protect K SRC DEST  a protected path from the vault: K is d (directory),
 *                         f (file) or l (symlink, SRC is the link's text)
 *   --seccomp FD          the sandbox's compiled seccomp program (sock_filter[])
 *   --ids OFFSET HOST UID the sandbox's id offset, the host id of the command,
 *                         and the id it has inside
 *   --layer-ids BASE      the host id the layers' root files have (the store's
 *                         canonical range): the layers are idmapped from it to
 *                         OFFSET, so they show the owners the sandbox sees
 *   --cwd DIR  --env K=V (repeat)  --tmp-mb N  -- ARGV...
 *
 * Two processes. This one (P) stays in the host's pid, user and mount namespaces,
 * as host root: code in the sandbox can neither signal nor trace it, and it
 * takes the command's exit status from waitpid(2). Its child (C) is forked into
 * the sandbox's pid namespace and does, as host root, before it gives anything up:
 *
 *   1. join the sandbox's cgroups (the edge's exec group on the pids tracking
 *      hierarchy), so a timeout's kill of that group takes the whole tree;
 *   2. enter the sandbox's mount namespace only to clone its task directories
 *      (open_tree, from descriptors opened with openat2 RESOLVE_IN_ROOT |
 *      RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV under the sandbox's root, so a
 *      symlink the sandbox planted resolves inside it, never in the host's view);
 *   3. in a new mount namespace of its own: an overlay of the image's own layers
 *      (never the sandbox's writable layer, forks' or checkpoints' layers) with a
 *      private, empty upper that receives only the mount points made here; the
 *      task directories on top (nosuid, nodev), each an overlay of the sandbox's
 *      tree under a private layer that holds the protected paths' mount points,
 *      with a private upper: nothing is ever written into the sandbox's own
 *      layer (whose space, inodes included, the sandbox may have used up), and
 *      what the command writes there stays its own; the protected paths bound
 *      read-only straight from the host's vault; a minimal /dev, a private /tmp;
 *      then the root is remounted read-only, a fresh /proc of the sandbox's pid
 *      namespace mounted, and pivot_root(2) drops the host's tree;
 *   4. join the sandbox's net, ipc, uts and cgroup namespaces, then make a user
 *      namespace of its own, owned by host root (P writes its maps): the sandbox's
 *      ids keep their meaning (files show their owners), but the command runs as
 *      an id that maps to a host id outside the sandbox's range, so nothing in the
 *      sandbox can become it, and the sandbox's root has no capability over this
 *      namespace (no signal, no ptrace, no /proc/<pid>/mem, root or environ);
 *   5. no capabilities, no_new_privs, the sandbox's seccomp filter, a clean
 *      environment, every descriptor but stdio closed; exec.
 *
 * No binary of the sandbox runs before the command itself, and the command is
 * found on a PATH that only holds image directories.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dsec-idmap.h"

#define MAX_ITEMS 64
#define MAX_LOWER 128
#define MAX_ENV 70000
#define MAX_CONFIG (64 << 20)
#define TRUSTED_RESOLVE (RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)

extern char **environ;

struct protect { char kind; const char *src, *dest; };

static int status_fd = -1;
static int ns_fd[6] = {-1, -1, -1, -1, -1, -1};
static const char *ns_names[6] = {"mnt", "pid", "net", "ipc", "uts", "cgroup"};
static int ns_types[6] = {CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP};
static int root_fd = -1, seccomp_fd = -1;
static int cgroup_fds[MAX_ITEMS];
static int n_cgroups;
static const char *scratch;
static const char *lowers[MAX_LOWER];
static int n_lowers;
static const char *tasks[MAX_ITEMS];
static int n_tasks;
static struct protect protects[MAX_ITEMS];
static int n_protects;
static long id_offset = -1, host_id = -1, inside_id = -1, layer_ids = -1;
static int layer_userns = -1; /* the idmap of the layers (dsec-idmap.h), made before the fork */
static const char *cwd = "/";
static char *envs[MAX_ENV + 1];
static int n_envs;
static long tmp_mb = 64;
static char **cmd;

static void report(const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof buf - 2) n = sizeof buf - 2;
    buf[n++] = '\n';
    if (status_fd >= 0) (void)!write(status_fd, buf, n); /* one write, < PIPE_BUF: atomic */
}

/* A setup step failed: say which, and end (the edge turns it into an error, not a result). */
static void die(const char *what, const char *arg) {
    int e = errno;
    report("E %s %s: %s", what, arg ? arg : "", strerror(e));
    _exit(125);
}

static long sys_openat2(int dirfd, const char *path, int flags, uint64_t resolve) {
    struct open_how how = {.flags = (uint64_t)flags | O_CLOEXEC, .mode = 0, .resolve = resolve};
    long r;
    do { r = syscall(SYS_openat2, dirfd, path, &how, sizeof how); } while (r < 0 && (errno == EAGAIN || errno == EINTR));
    return r;
}

static int sys_open_tree(int dirfd, const char *path, unsigned flags) {
    return (int)syscall(SYS_open_tree, dirfd, path, flags);
}

static int sys_move_mount(int from, int to) {
    return (int)syscall(SYS_move_mount, from, "", to, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH);
}

static int sys_mount_setattr(int fd, uint64_t set) {
    struct mount_attr attr = {.attr_set = set};
    return (int)syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr);
}

static int rel(const char *path, char *out, size_t n) {
    while (*path == '/') path++;
    if (!*path) path = ".";
    if (snprintf(out, n, "%s", path) >= (int)n) { errno = ENAMETOOLONG; return -1; }
    return 0;
}

/* Create `path` (and its parents) as directories under the new root `rfd`, resolving each
 * existing component inside that root (the image's own symlinks, such as /lib -> usr/lib, are
 * followed there). Returns an O_PATH descriptor of the directory. */
static int mkdir_in(int rfd, const char *path) {
    char buf[4096], cur[4096];
    if (rel(path, buf, sizeof buf) < 0) return -1;
    int dfd = (int)sys_openat2(rfd, ".", O_PATH | O_DIRECTORY, TRUSTED_RESOLVE);
    if (dfd < 0) return -1;
    cur[0] = 0;
    char *save = NULL;
    for (char *part = strtok_r(buf, "/", &save); part; part = strtok_r(NULL, "/", &save)) {
        if (strcmp(part, ".") == 0) continue;
        size_t len = strlen(cur);
        snprintf(cur + len, sizeof cur - len, "%s%s", len ? "/" : "", part);
        if (mkdirat(dfd, part, 0755) < 0 && errno != EEXIST) { close(dfd); return -1; }
        close(dfd);
        dfd = (int)sys_openat2(rfd, cur, O_PATH | O_DIRECTORY, TRUSTED_RESOLVE);
        if (dfd < 0) return -1;
    }
    return dfd;
}

/* The parent of `dest` under the new root (created as needed) and its last component. */
static int parent_in(int rfd, const char *dest, char *name, size_t n) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", dest);
    char *slash = strrchr(buf, '/');
    if (!slash || !slash[1]) { errno = EINVAL; return -1; }
    snprintf(name, n, "%s", slash + 1);
    if (slash == buf) return (int)sys_openat2(rfd, ".", O_PATH | O_DIRECTORY, TRUSTED_RESOLVE);
    *slash = 0;
    return mkdir_in(rfd, buf);
}

/* Make sure `name` under `dfd` is a mount point of the right kind (d, f) or the symlink (l):
 * what the image has there is replaced in the private upper (a whiteout), never in a layer. */
static void place(int dfd, const char *name, char kind, const char *link, const char *shown) {
    struct stat st;
    int have = fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (have) {
        int ok = (kind == 'd' && S_ISDIR(st.st_mode)) || (kind == 'f' && S_ISREG(st.st_mode));
        if (ok) return;
        if (unlinkat(dfd, name, S_ISDIR(st.st_mode) ? AT_REMOVEDIR : 0) < 0) die("replace", shown);
    }
    if (kind == 'd') {
        if (mkdirat(dfd, name, 0755) < 0) die("mkdir", shown);
    } else if (kind == 'f') {
        int fd = openat(dfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0) die("create", shown);
        close(fd);
    } else if (symlinkat(link, dfd, name) < 0) {
        die("symlink", shown);
    }
}

static void bind_host(const char *src, int target, uint64_t attrs, const char *shown) {
    int tree = sys_open_tree(AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (tree < 0) die("open_tree", src);
    if (sys_mount_setattr(tree, attrs) < 0) die("mount_setattr", shown);
    if (sys_move_mount(tree, target) < 0) die("move_mount", shown);
    close(tree);
}

static int is_under(const char *path, const char *dir, const char **restp) {
    size_t n = strlen(dir);
    if (strncmp(path, dir, n) != 0 || path[n] != '/') return 0;
    *restp = path + n + 1;
    return 1;
}

static void mount_dev(int rfd) {
    int dev = mkdir_in(rfd, "/dev");
    if (dev < 0) die("mkdir", "/dev");
    int fs = (int)syscall(SYS_fsopen, "tmpfs", FSOPEN_CLOEXEC);
    if (fs < 0) die("fsopen", "tmpfs");
    if (syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "mode", "0755", 0) < 0 ||
        syscall(SYS_fsconfig, fs, FSCONFIG_SET_STRING, "size", "1m", 0) < 0 ||
        syscall(SYS_fsconfig, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) < 0)
        die("fsconfig", "/dev");
    int m = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC);
    if (m < 0) die("fsmount", "/dev");
    close(fs);
    if (sys_move_mount(m, dev) < 0) die("move_mount", "/dev");
    close(dev);
    static const char *nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
    for (size_t i = 0; i < sizeof nodes / sizeof *nodes; i++) {
        char src[64];
        snprintf(src, sizeof src, "/dev/%s", nodes[i]);
        int fd = openat(m, nodes[i], O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0) die("create", src);
        close(fd);
        int t = (int)sys_openat2(m, nodes[i], O_PATH, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS);
        if (t < 0) die("open", src);
        bind_host(src, t, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, src);
        close(t);
    }
    static const char *links[][2] = {
        {"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"}, {"stdout", "/proc/self/fd/1"},
        {"stderr", "/proc/self/fd/2"}};
    for (size_t i = 0; i < sizeof links / sizeof *links; i++)
        if (symlinkat(links[i][1], m, links[i][0]) < 0) die("symlink", links[i][0]);
    if (mkdirat(m, "shm", 01777) < 0) die("mkdir", "/dev/shm");
    int shm = (int)sys_openat2(m, "shm", O_PATH | O_DIRECTORY, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS);
    if (shm < 0) die("open", "/dev/shm");
    char path[64], opts[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", shm);
    snprintf(opts, sizeof opts, "mode=1777,size=%ldm", tmp_mb);
    if (mount("shm", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts) < 0) die("mount", "/dev/shm");
    close(shm);
    /* Nothing more goes into /dev: read-only from here (the binds and /dev/shm keep theirs). */
    struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY};
    if (syscall(SYS_mount_setattr, m, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0) die("mount_setattr", "/dev");
    close(m);
}

static void write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die("open", path);
    size_t n = strlen(data);
    if (write(fd, data, n) != (ssize_t)n) die("write", path);
    close(fd);
}

/* The task directory `path` lies in, or -1. */
static int task_of(const char *path) {
    const char *rest;
    for (int j = 0; j < n_tasks; j++)
        if (is_under(path, tasks[j], &rest)) return j;
    return -1;
}

/* Whether protected path i lies inside one given before it (shortest first). */
static int under_other(int i) {
    const char *rest;
    for (int j = 0; j < i; j++)
        if (is_under(protects[i].dest, protects[j].dest, &rest)) return 1;
    return 0;
}

/* In the private layer `layer` (a directory of ours), the mount point of protected path p,
 * `rest` its path below the task directory: its parents as directories, itself as its kind.
 * In the overlay, a directory here hides whatever the sandbox has at that name unless that is
 * a directory too (then they merge, and the vault's bind covers it), a file or symlink hides
 * anything: the sandbox's tree is never changed, whatever it left there. */
static void mount_point_in(int layer, const struct protect *p, const char *rest) {
    char buf[4096];
    if (rel(rest, buf, sizeof buf) < 0) die("path", p->dest);
    int dfd = fcntl(layer, F_DUPFD_CLOEXEC, 3);
    if (dfd < 0) die("dup", p->dest);
    char *save = NULL, *part = strtok_r(buf, "/", &save);
    while (part) {
        char *next = strtok_r(NULL, "/", &save);
        if (!next) break;
        if (mkdirat(dfd, part, 0755) < 0 && errno != EEXIST) die("mkdir", p->dest);
        if (fchownat(dfd, part, (uid_t)id_offset, (gid_t)id_offset, AT_SYMLINK_NOFOLLOW) < 0) die("chown", p->dest);
        int sub = (int)sys_openat2(dfd, part, O_PATH | O_DIRECTORY, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS);
        if (sub < 0) die("open", p->dest);
        close(dfd);
        dfd = sub;
        part = next;
    }
    if (!part) { errno = EINVAL; die("protected path", p->dest); }
    place(dfd, part, p->kind, p->src, p->dest);
    if (fchownat(dfd, part, (uid_t)id_offset, (gid_t)id_offset, AT_SYMLINK_NOFOLLOW) < 0) die("chown", p->dest);
    close(dfd);
}

/* Each task directory: an overlay of the sandbox's tree (trees[i], gone: nothing) under a
 * private layer with the mount points of the protected paths inside it, and a private upper
 * on a tmpfs of --tmp-mb (charged to this command's own cgroup, never to the sandbox). */
static void mount_tasks(int rfd, int *trees) {
    char path[4096], opts[8192];
    snprintf(path, sizeof path, "%s/t", scratch);
    if (mkdir(path, 0700) < 0) die("mkdir", path);
    snprintf(opts, sizeof opts, "mode=0700,size=%ldm", tmp_mb);
    if (mount("dsec-trusted-work", path, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0) die("mount", path);
    for (int i = 0; i < n_tasks; i++) {
        static const char *subs[] = {"s", "a", "u", "w"}; /* layer, sandbox's tree, upper, work */
        for (int k = 0; k < 4; k++) {
            snprintf(path, sizeof path, "%s/t/%s%d", scratch, subs[k], i);
            if (mkdir(path, 0755) < 0) die("mkdir", path);
        }
        struct stat st = {.st_mode = S_IFDIR | 0755, .st_uid = (uid_t)id_offset, .st_gid = (gid_t)id_offset};
        int live = trees[i] >= 0;
        if (live) {
            if (fstat(trees[i], &st) < 0) die("stat", tasks[i]);
            snprintf(path, sizeof path, "%s/t/a%d", scratch, i);
            if (syscall(SYS_move_mount, trees[i], "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) < 0)
                die("move_mount", tasks[i]);
            close(trees[i]);
        }
        /* The merged root shows the upper's owner and mode: the sandbox's directory's. */
        snprintf(path, sizeof path, "%s/t/u%d", scratch, i);
        if (chown(path, st.st_uid, st.st_gid) < 0 || chmod(path, st.st_mode & 07777) < 0) die("chown", path);
        snprintf(path, sizeof path, "%s/t/s%d", scratch, i);
        int layer = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (layer < 0) die("open", path);
        for (int j = 0; j < n_protects; j++) {
            const char *rest;
            if (task_of(protects[j].dest) == i && !under_other(j) && is_under(protects[j].dest, tasks[i], &rest))
                mount_point_in(layer, &protects[j], rest);
        }
        close(layer);
        if (live)
            snprintf(opts, sizeof opts, "lowerdir=%s/t/s%d:%s/t/a%d,upperdir=%s/t/u%d,workdir=%s/t/w%d",
                     scratch, i, scratch, i, scratch, i, scratch, i);
        else
            snprintf(opts, sizeof opts, "lowerdir=%s/t/s%d,upperdir=%s/t/u%d,workdir=%s/t/w%d",
                     scratch, i, scratch, i, scratch, i);
        int t = mkdir_in(rfd, tasks[i]);
        if (t < 0) die("mkdir", tasks[i]);
        snprintf(path, sizeof path, "/proc/self/fd/%d", t);
        if (mount("dsec-task", path, "overlay", MS_NOSUID | MS_NODEV, opts) < 0) die("mount overlay", tasks[i]);
        close(t);
    }
}

static void child(int ready_w, int go_r) {
    char path[4096], opts[8192];
    /* P ends (the edge killed it): so does everything set up here, before the command. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (int i = 0; i < n_cgroups; i++) {
        if (write(cgroup_fds[i], "0", 1) != 1) die("join cgroup", NULL);
        close(cgroup_fds[i]);
    }
    /* 2. The task directories, cloned from the sandbox's own mount namespace. */
    int trees[MAX_ITEMS];
    int host_mnt = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (host_mnt < 0) die("open", "/proc/self/ns/mnt");
    if (setns(ns_fd[0], CLONE_NEWNS) < 0) die("setns", "mnt");
    for (int i = 0; i < n_tasks; i++) {
        if (rel(tasks[i], path, sizeof path) < 0) die("path", tasks[i]);
        int fd = (int)sys_openat2(root_fd, path, O_PATH | O_DIRECTORY, TRUSTED_RESOLVE | RESOLVE_NO_XDEV);
        if (fd < 0) {
            if (errno == ENOENT || errno == ENOTDIR || errno == ELOOP || errno == EXDEV) {
                trees[i] = -1; /* gone, or leads elsewhere: the command sees an empty directory */
                continue;
            }
            die("open task directory", tasks[i]);
        }
        trees[i] = sys_open_tree(fd, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
        if (trees[i] < 0) die("open_tree", tasks[i]);
        close(fd);
    }
    if (setns(host_mnt, CLONE_NEWNS) < 0) die("setns", "host mnt");
    close(host_mnt);
    close(root_fd);
    close(ns_fd[0]);

    /* 3. A mount namespace of our own (nothing here reaches the host's mount table). */
    if (unshare(CLONE_NEWNS) < 0) die("unshare", "mnt");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make-rprivate", "/");
    if (mount("dsec-trusted", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0700") < 0)
        die("mount", scratch);
    static const char *subs[] = {"u", "w", "r"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", scratch, subs[i]);
        if (mkdir(path, 0755) < 0) die("mkdir", path);
    }
    size_t off = (size_t)snprintf(opts, sizeof opts, "lowerdir=");
    for (int i = 0; i < n_lowers; i++) {
        /* Each layer a read-only clone, idmapped to the sandbox's range when it has its own. */
        snprintf(path, sizeof path, "%s/l%d", scratch, i);
        if (mkdir(path, 0700) < 0) die("mkdir", path);
        if (idmap_bind(lowers[i], path, layer_userns) < 0) die("mount layer", lowers[i]);
        off += (size_t)snprintf(opts + off, sizeof opts - off, "%s%s", i ? ":" : "", path);
        if (off >= sizeof opts) { errno = E2BIG; die("overlay options", NULL); }
    }
    if (layer_userns >= 0) close(layer_userns);
    off += (size_t)snprintf(opts + off, sizeof opts - off, ",upperdir=%s/u,workdir=%s/w", scratch, scratch);
    if (off >= sizeof opts) { errno = E2BIG; die("overlay options", NULL); }
    snprintf(path, sizeof path, "%s/r", scratch);
    if (mount("dsec-trusted-root", path, "overlay", MS_NOSUID | MS_NODEV, opts) < 0) die("mount overlay", path);
    int rfd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rfd < 0) die("open", path);

    /* Task directories: the sandbox's tree (read as it is: its processes are frozen or gone)
     * under a private layer of mount points, with a private upper (nosuid, nodev). */
    mount_tasks(rfd, trees);
    /* Protected paths, shortest first (a path inside another one lands on its mount point). */
    for (int i = 0; i < n_protects; i++) {
        struct protect *p = &protects[i];
        int target;
        if (task_of(p->dest) >= 0 || under_other(i)) {
            /* In a task directory (its mount point is in the private layer mount_tasks made) or
             * inside another protected tree (the vault's copy holds it): nothing is followed. */
            target = (int)sys_openat2(rfd, p->dest + 1, p->kind == 'd' ? O_PATH | O_DIRECTORY : O_PATH,
                                      RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
            if (target < 0 && p->kind != 'l') die("protected mount point", p->dest);
            if (p->kind == 'l') { if (target >= 0) close(target); continue; } /* the layer, the copy hold it */
        } else {
            char name[256];
            int dfd = parent_in(rfd, p->dest, name, sizeof name);
            if (dfd < 0) die("protected parent", p->dest);
            place(dfd, name, p->kind, p->src, p->dest);
            if (p->kind == 'l') { close(dfd); continue; }
            target = (int)sys_openat2(dfd, name, p->kind == 'd' ? O_PATH | O_DIRECTORY : O_PATH,
                                      RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS);
            if (target < 0) die("protected mount point", p->dest);
            close(dfd);
        }
        bind_host(p->src, target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, p->dest);
        close(target);
    }
    /* A private /tmp and a minimal /dev; /proc comes after the pid namespace is ours. */
    int t = mkdir_in(rfd, "/tmp");
    if (t < 0) die("mkdir", "/tmp");
    snprintf(path, sizeof path, "/proc/self/fd/%d", t);
    snprintf(opts, sizeof opts, "mode=1777,size=%ldm", tmp_mb);
    if (mount("dsec-tmp", path, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0) die("mount", "/tmp");
    close(t);
    mount_dev(rfd);
    int procdir = mkdir_in(rfd, "/proc");
    if (procdir < 0) die("mkdir", "/proc");
    /* The image's tree can change no more: read-only (the mounts on it keep their own flags). */
    snprintf(path, sizeof path, "%s/r", scratch);
    if (mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
        die("remount read-only", path);
    snprintf(path, sizeof path, "/proc/self/fd/%d", procdir);
    if (mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) die("mount", "/proc");
    close(procdir);

    /* 4. The sandbox's other namespaces, then the new root. */
    for (int i = 2; i < 6; i++) {
        if (ns_fd[i] < 0) continue;
        if (setns(ns_fd[i], ns_types[i]) < 0) die("setns", ns_names[i]);
        close(ns_fd[i]);
    }
    if (fchdir(rfd) < 0) die("chdir", "new root");
    if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root", NULL);
    if (umount2(".", MNT_DETACH) < 0) die("umount", "old root");
    if (chdir("/") < 0) die("chdir", "/");
    close(rfd);

    /* The seccomp program, read while we still may. */
    struct sock_filter *prog = NULL;
    size_t prog_len = 0;
    if (seccomp_fd >= 0) {
        struct stat st;
        if (fstat(seccomp_fd, &st) < 0 || st.st_size <= 0 || st.st_size % sizeof *prog || st.st_size > (1 << 20)) {
            errno = EINVAL;
            die("seccomp program", NULL);
        }
        prog = malloc((size_t)st.st_size);
        if (!prog || pread(seccomp_fd, prog, (size_t)st.st_size, 0) != st.st_size) die("read", "seccomp program");
        prog_len = (size_t)st.st_size / sizeof *prog;
        close(seccomp_fd);
    }

    if (unshare(CLONE_NEWUSER) < 0) die("unshare", "user");
    char c = 'u';
    if (write(ready_w, &c, 1) != 1) die("sync", NULL);
    close(ready_w);
    if (read(go_r, &c, 1) != 1 || c != 'g') _exit(125); /* P said why */
    close(go_r);

    /* 5. Nothing of host root is left: no capability anywhere, no way to regain one. */
    for (int cap = 0; cap <= 63; cap++) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    if (setgroups(0, NULL) < 0) die("setgroups", NULL);
    if (setresgid((gid_t)inside_id, (gid_t)inside_id, (gid_t)inside_id) < 0) die("setresgid", NULL);
    if (setresuid((uid_t)inside_id, (uid_t)inside_id, (uid_t)inside_id) < 0) die("setresuid", NULL);
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* cleared by the id change */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs", NULL);
    umask(022);
    struct rlimit nofile = {16384, 16384}, core = {0, 0};
    setrlimit(RLIMIT_NOFILE, &nofile);
    setrlimit(RLIMIT_CORE, &core);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid();
    environ = envs;
    int bad_cwd = chdir(cwd) < 0 ? errno : 0;
    int st_fd = status_fd;
    status_fd = -1;
    close(st_fd);
    syscall(SYS_close_range, 3, ~0U, 0);
    if (bad_cwd) {
        fprintf(stderr, "dsec: cannot enter the working directory %s: %s\n", cwd, strerror(bad_cwd));
        _exit(127);
    }
    if (prog) {
        struct sock_fprog fprog = {.len = (unsigned short)prog_len, .filter = prog};
        if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_LOG, &fprog) < 0 &&
            syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &fprog) < 0) {
            fprintf(stderr, "dsec: cannot load the seccomp filter: %s\n", strerror(errno));
            _exit(125);
        }
    }
    execvp(cmd[0], cmd);
    int e = errno;
    fprintf(stderr, "dsec: cannot run %s: %s\n", cmd[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
}

static long num(const char *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || !*s || *end) { fprintf(stderr, "dsec-trusted: bad number %s\n", s); exit(2); }
    return v;
}

static void usage(const char *why) {
    fprintf(stderr, "dsec-trusted: %s (see the source for the options)\n", why);
    exit(2);
}

static void parse(int argc, char **argv) {
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
#define NEED(n) do { if (i + (n) >= argc) usage("missing argument"); } while (0)
        if (strcmp(a, "--") == 0) { i++; break; }
        else if (strcmp(a, "--status") == 0) { NEED(1); status_fd = (int)num(argv[++i]); }
        else if (strcmp(a, "--ns") == 0) {
            NEED(2);
            int k = -1;
            for (int j = 0; j < 6; j++) if (strcmp(argv[i + 1], ns_names[j]) == 0) k = j;
            if (k < 0) usage("unknown namespace");
            ns_fd[k] = (int)num(argv[i + 2]);
            i += 2;
        }
        else if (strcmp(a, "--root") == 0) { NEED(1); root_fd = (int)num(argv[++i]); }
        else if (strcmp(a, "--cgroup") == 0) {
            NEED(1);
            if (n_cgroups >= MAX_ITEMS) usage("too many cgroups");
            cgroup_fds[n_cgroups++] = (int)num(argv[++i]);
        }
        else if (strcmp(a, "--scratch") == 0) { NEED(1); scratch = argv[++i]; }
        else if (strcmp(a, "--lower") == 0) {
            NEED(1);
            if (n_lowers >= MAX_LOWER) usage("too many layers");
            lowers[n_lowers++] = argv[++i];
        }
        else if (strcmp(a, "--task") == 0) {
            NEED(1);
            if (n_tasks >= MAX_ITEMS) usage("too many task directories");
            tasks[n_tasks++] = argv[++i];
        }
        else if (strcmp(a, "--protect") == 0) {
            NEED(3);
            if (n_protects >= MAX_ITEMS) usage("too many protected paths");
            char k = argv[i + 1][0];
            if ((k != 'd' && k != 'f' && k != 'l') || argv[i + 1][1]) usage("protect kind is d, f or l");
            protects[n_protects++] = (struct protect){k, argv[i + 2], argv[i + 3]};
            i += 3;
        }
        else if (strcmp(a, "--seccomp") == 0) { NEED(1); seccomp_fd = (int)num(argv[++i]); }
        else if (strcmp(a, "--ids") == 0) {
            NEED(3);
            id_offset = num(argv[i + 1]);
            host_id = num(argv[i + 2]);
            inside_id = num(argv[i + 3]);
            i += 3;
        }
        else if (strcmp(a, "--layer-ids") == 0) { NEED(1); layer_ids = num(argv[++i]); }
        else if (strcmp(a, "--cwd") == 0) { NEED(1); cwd = argv[++i]; }
        else if (strcmp(a, "--env") == 0) {
            NEED(1);
            if (n_envs >= MAX_ENV) usage("too many environment variables");
            envs[n_envs++] = argv[++i];
        }
        else if (strcmp(a, "--tmp-mb") == 0) { NEED(1); tmp_mb = num(argv[++i]); }
        else usage("unknown option");
#undef NEED
    }
    envs[n_envs] = NULL;
    if (i >= argc) usage("no command");
    cmd = argv + i;
    if (status_fd < 0 || root_fd < 0 || !scratch || n_lowers == 0 || ns_fd[0] < 0 || ns_fd[1] < 0)
        usage("--status, --root, --scratch, --lower, --ns mnt and --ns pid are required");
    if (id_offset < 0 || host_id < 0 || inside_id < 0 || inside_id >= 65536 || tmp_mb <= 0)
        usage("--ids OFFSET HOST UID and --tmp-mb are required");
    for (int j = 0; j < n_tasks; j++)
        if (tasks[j][0] != '/') usage("task directories are absolute paths");
    for (int j = 0; j < n_protects; j++)
        if (protects[j].dest[0] != '/' || !protects[j].dest[1]) usage("protected paths are absolute, not /");
}

/* The options from descriptor `fd`: NUL-terminated strings, as argv[1..]. */
static void load(const char *fd_arg, int *argc, char ***argv) {
    int fd = (int)num(fd_arg);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) usage("out of memory");
        if (len == cap) {
            if (cap >= MAX_CONFIG) usage("options too large");
            cap *= 2;
            buf = realloc(buf, cap);
            continue;
        }
        ssize_t n = pread(fd, buf + len, cap - len, (off_t)len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) usage("cannot read the options");
        if (n == 0) break;
        len += (size_t)n;
    }
    close(fd);
    if (len && buf[len - 1]) usage("the options must end with a NUL");
    int n = 1;
    for (size_t i = 0; i < len; i++) n += !buf[i];
    char **v = calloc((size_t)n + 1, sizeof *v);
    if (!v) usage("out of memory");
    v[0] = "dsec-trusted";
    int k = 1;
    for (size_t i = 0, start = 0; i < len; i++)
        if (!buf[i]) { v[k++] = buf + start; start = i + 1; }
    *argc = k;
    *argv = v;
}

int main(int argc, char **argv) {
    if (argc != 2) usage("one argument: the descriptor that holds the options");
    load(argv[1], &argc, &argv);
    parse(argc, argv);
    /* The command's uid maps to a host id no sandbox maps; the sandbox's other ids keep theirs. */
    char map[256];
    snprintf(map, sizeof map, "0 %ld %ld\n%ld %ld 1\n", id_offset, inside_id, inside_id, host_id);
    if (inside_id + 1 < 65536) {
        size_t n = strlen(map);
        snprintf(map + n, sizeof map - n, "%ld %ld %ld\n", inside_id + 1, id_offset + inside_id + 1, 65535 - inside_id);
    }
    if (inside_id == 0) snprintf(map, sizeof map, "0 %ld 1\n1 %ld 65535\n", host_id, id_offset + 1);
    /* Here, before joining the sandbox's pid namespace: the short-lived process that
     * carries the idmap's user namespace is never visible inside. */
    if (layer_ids >= 0 && layer_ids != id_offset && (layer_userns = idmap_userns(layer_ids, id_offset, 65536)) < 0)
        die("idmap user namespace", NULL);
    if (setns(ns_fd[1], CLONE_NEWPID) < 0) die("setns", "pid");
    close(ns_fd[1]);
    int ready[2], go[2];
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(go, O_CLOEXEC) < 0) die("pipe", NULL);
    pid_t pid = fork();
    if (pid < 0) die("fork into the sandbox", NULL);
    if (pid == 0) {
        close(ready[0]);
        close(go[1]);
        child(ready[1], go[0]);
    }
    close(ready[1]);
    close(go[0]);
    /* Hold nothing the command's end depends on: its output ends when its processes end. */
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int i = 0; i < 3; i++) dup2(devnull, i);
    char c;
    ssize_t n;
    do { n = read(ready[0], &c, 1); } while (n < 0 && errno == EINTR);
    if (n == 1) {
        char file[64];
        snprintf(file, sizeof file, "/proc/%d/uid_map", pid);
        write_file(file, map);
        snprintf(file, sizeof file, "/proc/%d/gid_map", pid);
        write_file(file, map);
        c = 'g';
        if (write(go[1], &c, 1) != 1) { /* the child is gone: its status says how */ }
    }
    close(go[1]);
    close(ready[0]);
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) die("waitpid", NULL);
    }
    report("X %d", status);
    return 0;
}
