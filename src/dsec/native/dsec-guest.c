/*
 * dsec-guest: PID 1 of a microVM guest, the agent the edge talks to (backend "microvm").
 *
 * The guest boots from an initramfs holding only this binary and the kernel modules it
 * loads (modules/NN-name.ko, in order). It opens the virtio-serial port "dsec" (the
 * only way in: there is no network service and no vsock) and says 'H'. The host may
 * take the VM's memory image right there (a template: every sandbox of an image starts
 * from it), so nothing specific to one sandbox happens before the host's 'M' (setup):
 * fresh entropy and the clock, the layers (read-only EROFS disks vda.., in order, top
 * first) under an overlay whose upper is the sandbox's own writable ext4 disk (the last
 * one; disks are found by their serial), the usual /proc, /dev, /sys, then a chroot into it. The initramfs is emptied
 * first, so what a process might reach outside the chroot holds nothing.
 *
 * Then it speaks the shim's protocol (dsec-shim.c), framed on the port's byte stream
 * instead of datagrams with descriptors: stdio travels in frames.
 *   frame: u8 type, u32 id, u32 len, then len bytes (little endian)
 *   host -> guest  'M' setup      u32 seed_len, seed, i64 sec, i64 nsec, u8 nlower,
 *                                 u32 pids, NUL-terminated hostname, addr/prefix, gateway,
 *                                 then optionally u32 len + seccomp program, u16 n + masked
 *                                 paths, u16 n + read-only paths, u64 memory bytes
 *                  'S' spawn      i32 uid, i32 gid, u16 argc, u16 envc, u8 flags,
 *                                 NUL-terminated cwd, argv, env; flags 1: no program but
 *                                 the agent's own archiver, which writes the writable
 *                                 layer as a tar on its stdout (a snapshot: see tar_layer),
 *                                 or with argv[1] a path, the tree there (tar_path)
 *                  'Z' resumed    u32 seed_len, seed, i64 sec, i64 nsec, hostname: a VM
 *                                 restored from a memory checkpoint takes fresh entropy,
 *                                 the clock and its new name; the processes of the old host
 *                                 lose their stdio (their caller is gone) and run on
 *                  'I' stdin      bytes for the process's stdin; empty: close it
 *                  'K' signal     i32 signal (SIGKILL also kills its cgroup)
 *                  'P' ping
 *                  'Q' quiesce    u8 1: flush the writable disk and hold its writers, 0: release
 *                  'U' kill all   every sandbox process (before a verifier, after a checkpoint)
 *   guest -> host  'H' hello, 'm' setup done (i32 errno, 0 on success)
 *                  'R' started (i32 pid), 'F' failed (i32 errno), 'X' exited (i32 status,
 *                  u32 disk full, u64 disk bytes used, u64 disk inodes used)
 *                  'O' / 'E' stdout / stderr bytes; empty: end of that stream
 *                  'p' pong, 'q' quiesced (i32 errno, 0 on success), 'z' resumed (i32 errno),
 *                  'u' all killed (i32 errno)
 * A process's 'X' comes after the last of its output that was in its pipes when it
 * exited, so a reader that stops at 'X' misses nothing the process itself wrote.
 *
 * What a sandbox process is: its own session and guest cgroup (a timeout kills the cgroup,
 * setsid does not leave it), the container backend's capability set and no more (no
 * CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_MKNOD, CAP_SYS_CHROOT), no new
 * privileges. The agent is non-dumpable, so no process can ptrace it or open its
 * descriptors through /proc; the cgroup file system is mounted nowhere a process can see
 * (the agent holds a detached mount). The guest kernel is the sandbox's: code running as
 * root inside may still find a kernel bug, and what it could then forge is what this
 * agent reports; the host side trusts nothing else of the guest.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <linux/fs.h>
#include <linux/random.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define PORT "/dev/vport0p1"
#define MAX_FRAME (262144 + 64)
#define MAX_PROCS 1024
#define OUT_CAP (8 << 20)        /* the port's send queue */
#define OUT_HIGH (1 << 20)       /* above it, stop reading the processes' output */
#define IN_CAP (16 << 20)        /* stdin held for one process that does not read it */
#define CHUNK 32768

extern char **environ;

#include "dsec-child.h"
#include "dsec-levels.h"

struct proc {
    uint32_t id;
    pid_t pid;               /* 0: free slot */
    int in, out, err;        /* our ends of its stdin, stdout and stderr pipes (-1: closed) */
    char *inbuf;             /* stdin not yet taken by the pipe */
    size_t inlen, inoff;
    int in_eof;              /* the host closed stdin: close the pipe once inbuf is written */
    int status, exited;      /* reaped; 'X' goes once out and err are drained */
    char cg[16];
};

static struct proc procs[MAX_PROCS];
/* Ended processes whose guest cgroup still held something they started (a session run's
 * background jobs): a SIGKILL for their id still ends those (a session's close). */
#define RECENT 256
static struct { uint32_t id; char cg[16]; } recent[RECENT];
static unsigned recent_next;
static int port = -1, ep = -1, cgroot = -1, rwfd = -1; /* rwfd: the writable disk's root */
static char *outq;
static size_t outlen, outoff;
static int reading_paused;
static uint32_t user_pids = 1024;
static uint64_t user_memory; /* bytes for all the sandbox's processes together (0: no limit) */
static struct sock_fprog user_filter; /* installed in every process before its exec (setup) */

static void die(const char *what) {
    /* Nothing to report to: the console is the only witness (and the host sees the VM end). */
    int fd = open("/dev/console", O_WRONLY | O_NOCTTY);
    if (fd >= 0) {
        dprintf(fd, "dsec-guest: %s: %s\n", what, strerror(errno));
        close(fd);
    }
    sync();
    reboot_now:
    syscall(SYS_reboot, 0xfee1dead, 672274793, 0x4321fedc, NULL); /* power off */
    goto reboot_now;
}

/* --- the port ------------------------------------------------------------------------ */

static void flush_port(void);

static void send_frame(char type, uint32_t id, const void *data, uint32_t len) {
    if (outlen + 9 + len > OUT_CAP) return; /* the host does not read: drop (it will see gaps) */
    char *p = outq + outlen;
    p[0] = type;
    memcpy(p + 1, &id, 4);
    memcpy(p + 5, &len, 4);
    if (len) memcpy(p + 9, data, len);
    outlen += 9 + len;
    flush_port();
}

static void send_value(char type, uint32_t id, int32_t value) { send_frame(type, id, &value, 4); }

static void update_port_events(void);

static void flush_port(void) {
    while (outoff < outlen) {
        ssize_t n = write(port, outq + outoff, outlen - outoff);
        if (n > 0) { outoff += n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno != EAGAIN) outoff = outlen; /* host gone: drop what was queued */
        break;
    }
    if (outoff == outlen) outoff = outlen = 0;
    else if (outoff > OUT_CAP / 2) {
        memmove(outq, outq + outoff, outlen - outoff);
        outlen -= outoff;
        outoff = 0;
    }
    update_port_events();
}

static void watch(int fd, uint32_t events, uint64_t key) {
    struct epoll_event ev = {.events = events, .data.u64 = key};
    if (epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev) < 0 && errno == ENOENT) epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

/* keys: 0 the port, 1 the signalfd, 2 + 4*slot + {0 stdin, 1 stdout, 2 stderr} */
static void set_output_watch(int pause) {
    for (int i = 0; i < MAX_PROCS; i++) {
        if (!procs[i].pid) continue;
        if (procs[i].out >= 0) watch(procs[i].out, pause ? 0 : EPOLLIN, 2 + 4 * i + 1);
        if (procs[i].err >= 0) watch(procs[i].err, pause ? 0 : EPOLLIN, 2 + 4 * i + 2);
    }
    reading_paused = pause;
}

static void update_port_events(void) {
    if (ep < 0 || port < 0) return;
    watch(port, EPOLLIN | (outlen > outoff ? EPOLLOUT : 0), 0);
    size_t pending = outlen - outoff;
    if (!reading_paused && pending > OUT_HIGH) set_output_watch(1);
    else if (reading_paused && pending < OUT_HIGH / 2) set_output_watch(0);
}

/* --- processes ----------------------------------------------------------------------- */

static void close_fd(int *fd) {
    if (*fd >= 0) {
        epoll_ctl(ep, EPOLL_CTL_DEL, *fd, NULL);
        close(*fd);
        *fd = -1;
    }
}

static void maybe_finish(struct proc *p) {
    if (!p->exited || p->out >= 0 || p->err >= 0) return;
    /* with the status, the writable disk's use: bytes used, inodes used, and whether either
     * ran out (the host cannot look into the disk itself) */
    struct { int32_t status; uint32_t full; uint64_t bytes, inodes; } __attribute__((packed)) x = {p->status, 0, 0, 0};
    struct statvfs st;
    if (rwfd >= 0 && fstatvfs(rwfd, &st) == 0) {
        x.bytes = (uint64_t)(st.f_blocks - st.f_bfree) * st.f_frsize;
        x.inodes = st.f_files - st.f_ffree;
        x.full = st.f_bavail == 0 || st.f_favail == 0;
    }
    send_frame('X', p->id, &x, sizeof x);
    close_fd(&p->in);
    free(p->inbuf);
    if (cgroot >= 0 && p->cg[0] && unlinkat(cgroot, p->cg, AT_REMOVEDIR) < 0 && errno == EBUSY) {
        unsigned slot = recent_next++ % RECENT;
        if (recent[slot].cg[0]) unlinkat(cgroot, recent[slot].cg, AT_REMOVEDIR); /* (forgotten) */
        recent[slot].id = p->id;
        memcpy(recent[slot].cg, p->cg, sizeof recent[slot].cg);
    }
    memset(p, 0, sizeof *p);
    p->in = p->out = p->err = -1;
}

/* Read what the pipe holds now (all of it when `drain`, else one chunk); at its end, say so. */
static void pump_output(struct proc *p, int which, int drain) {
    static char buf[CHUNK];
    int *fd = which == 1 ? &p->out : &p->err;
    char type = which == 1 ? 'O' : 'E';
    while (*fd >= 0) {
        ssize_t n = read(*fd, buf, sizeof buf);
        if (n > 0) {
            send_frame(type, p->id, buf, (uint32_t)n);
            if (!drain) return;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) {
            /* It exited: what is still open is held by something it started in the
             * background. Its own output is all sent; stop here (the stream ends). */
            if (!p->exited) return;
        }
        close_fd(fd);
        send_frame(type, p->id, NULL, 0);
    }
}

static void pump_input(struct proc *p) {
    while (p->in >= 0 && p->inoff < p->inlen) {
        ssize_t n = write(p->in, p->inbuf + p->inoff, p->inlen - p->inoff);
        if (n > 0) { p->inoff += n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) {
            watch(p->in, EPOLLOUT, 2 + 4 * (p - procs));
            return;
        }
        close_fd(&p->in); /* EPIPE: it closed its stdin */
    }
    if (p->inoff == p->inlen) {
        p->inoff = p->inlen = 0;
        if (p->in >= 0) {
            if (p->in_eof) close_fd(&p->in);
            else watch(p->in, 0, 2 + 4 * (p - procs));
        }
    }
}

static struct proc *find(uint32_t id) {
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i].pid && procs[i].id == id) return &procs[i];
    return NULL;
}

static void kill_cgroup(const char *cg) {
    char path[64];
    snprintf(path, sizeof path, "%s/cgroup.kill", cg);
    int fd = openat(cgroot, path, O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        (void)!write(fd, "1", 1);
        close(fd);
    }
}

static void reap(void) {
    int status;
    pid_t pid;
    for (unsigned i = 0; cgroot >= 0 && i < RECENT; i++) /* emptied since: removed */
        if (recent[i].cg[0] && unlinkat(cgroot, recent[i].cg, AT_REMOVEDIR) == 0) recent[i].cg[0] = 0;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_PROCS; i++) {
            struct proc *p = &procs[i];
            if (p->pid != pid) continue;
            p->status = status;
            p->exited = 1;
            if (p->out >= 0) pump_output(p, 1, 1);
            if (p->err >= 0) pump_output(p, 2, 1);
            maybe_finish(p);
            break;
        }
    }
}

static const int user_caps[] = {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL,
                                CAP_SETGID, CAP_SETUID, CAP_NET_BIND_SERVICE};

static int drop_capabilities(void) {
    uint64_t keep = 0;
    for (size_t i = 0; i < sizeof user_caps / sizeof user_caps[0]; i++) keep |= 1ULL << user_caps[i];
    for (int c = 0; c <= 63; c++) {
        if (keep & (1ULL << c)) continue;
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    }
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2] = {{0}};
    data[0].effective = data[0].permitted = (uint32_t)keep; /* inheritable: none */
    if (syscall(SYS_capset, &hdr, data) < 0) return -1;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
}

static void child_exec(int errfd, int pin, int pout, int perr, int cgprocs, int32_t uid, int32_t gid,
                       const char *cwd, char **argv, char **envp, const struct ns_level *level) {
    int err = ns_join(level); /* (forked into its PID namespace: ns_fork) */
    child_reset_signals();
    setsid();
    if (cgprocs >= 0 && write(cgprocs, "0", 1) != 1) err = errno;
    if (!err) err = child_stdio(pin, pout, perr, &errfd);
    if (!err && gid >= 0 && (setgroups(0, NULL) < 0 || setresgid(gid, gid, gid) < 0)) err = errno;
    if (!err && drop_capabilities() < 0) err = errno;
    if (!err && uid >= 0 && setresuid(uid, uid, uid) < 0) err = errno;
    if (!err) err = child_own_domain(); /* (no_new_privs: drop_capabilities set it) */
    if (!err && user_filter.len && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &user_filter) < 0) err = errno;
    if (!err && cwd[0] && chdir(cwd) < 0) err = errno;
    child_run(err, errfd, argv, envp);
}

#include "dsec-archiver.h"

static void handle_spawn(uint32_t id, const char *buf, uint32_t len) {
    int32_t uid, gid;
    uint16_t argc, envc;
    if (len < 13) { send_value('F', id, EINVAL); return; }
    memcpy(&uid, buf, 4);
    memcpy(&gid, buf + 4, 4);
    memcpy(&argc, buf + 8, 2);
    memcpy(&envc, buf + 10, 2);
    unsigned char flags = (unsigned char)buf[12];
    int slot = -1;
    for (int i = 0; i < MAX_PROCS; i++)
        if (!procs[i].pid) { slot = i; break; }
    if (slot < 0) { send_value('F', id, EAGAIN); return; }
    if (argc == 0 || find(id)) { send_value('F', id, EINVAL); return; }
    char **argv = calloc(argc + 1, sizeof(char *));
    char **envp = calloc(envc + 1, sizeof(char *));
    const char *p = buf + 13, *end = buf + len, *cwd = NULL;
    for (int i = 0; i < 1 + argc + envc; i++) {
        const char *z = memchr(p, 0, end - p);
        if (!z) { free(argv); free(envp); send_value('F', id, EINVAL); return; }
        if (i == 0) cwd = p;
        else if (i <= argc) argv[i - 1] = (char *)p;
        else envp[i - 1 - argc] = (char *)p;
        p = z + 1;
    }
    int in[2] = {-1, -1}, out[2] = {-1, -1}, er[2] = {-1, -1}, errpipe[2] = {-1, -1}, cgprocs = -1;
    struct proc *pr = &procs[slot];
    snprintf(pr->cg, sizeof pr->cg, "x%u", id);
    if (cgroot >= 0 && mkdirat(cgroot, pr->cg, 0700) == 0) {
        char path[64];
        snprintf(path, sizeof path, "%s/cgroup.procs", pr->cg);
        cgprocs = openat(cgroot, path, O_WRONLY | O_CLOEXEC);
    } else {
        pr->cg[0] = 0;
    }
    int e = 0;
    if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(er, O_CLOEXEC) < 0 ||
        pipe2(errpipe, O_CLOEXEC) < 0)
        e = errno;
    const struct ns_level *level = NULL;
    pid_t pid = e ? -1 : (flags & 1) ? fork() : ns_fork(&level);
    if (pid == 0 && (flags & 1)) child_archive(errpipe[1], out[1], er[1], argc > 1 ? argv[1] : NULL);
    if (pid == 0) child_exec(errpipe[1], in[0], out[1], er[1], cgprocs, uid, gid, cwd, argv, envp, level);
    if (!e && pid < 0) e = errno;
    free(argv);
    free(envp);
    int child_err = 0;
    if (!e) {
        close(errpipe[1]);
        errpipe[1] = -1;
        ssize_t n;
        do { n = read(errpipe[0], &child_err, sizeof child_err); } while (n < 0 && errno == EINTR);
        if (n == sizeof child_err) { waitpid(pid, NULL, 0); e = child_err; }
    }
    int fds[] = {in[0], out[1], er[1], errpipe[0], errpipe[1], cgprocs};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++) if (fds[i] >= 0) close(fds[i]);
    if (e) {
        int mine[] = {in[1], out[0], er[0]};
        for (int i = 0; i < 3; i++) if (mine[i] >= 0) close(mine[i]);
        if (pr->cg[0]) unlinkat(cgroot, pr->cg, AT_REMOVEDIR);
        memset(pr, 0, sizeof *pr);
        send_value('F', id, e);
        return;
    }
    pr->id = id;
    pr->pid = pid;
    pr->in = in[1];
    pr->out = out[0];
    pr->err = er[0];
    fcntl(pr->in, F_SETFL, O_NONBLOCK);
    fcntl(pr->out, F_SETFL, O_NONBLOCK);
    fcntl(pr->err, F_SETFL, O_NONBLOCK);
    struct epoll_event ev = {.events = 0, .data.u64 = 2 + 4 * slot};
    epoll_ctl(ep, EPOLL_CTL_ADD, pr->in, &ev);
    ev.events = reading_paused ? 0 : EPOLLIN;
    ev.data.u64 = 2 + 4 * slot + 1;
    epoll_ctl(ep, EPOLL_CTL_ADD, pr->out, &ev);
    ev.data.u64 = 2 + 4 * slot + 2;
    epoll_ctl(ep, EPOLL_CTL_ADD, pr->err, &ev);
    send_value('R', id, pid);
}

static void handle_stdin(uint32_t id, const char *buf, uint32_t len) {
    struct proc *p = find(id);
    if (!p || p->in < 0) return;
    if (len == 0) {
        p->in_eof = 1;
    } else {
        if (p->inlen + len > IN_CAP) { close_fd(&p->in); return; }
        char *nb = realloc(p->inbuf, p->inlen + len);
        if (!nb) { close_fd(&p->in); return; }
        p->inbuf = nb;
        memcpy(p->inbuf + p->inlen, buf, len);
        p->inlen += len;
    }
    pump_input(p);
}

static void handle_kill(uint32_t id, const char *buf, uint32_t len) {
    int32_t sig;
    struct proc *p = find(id);
    if (len < 4) return;
    memcpy(&sig, buf, 4);
    if (!p) { /* ended: what it left in its cgroup, if it still lives */
        for (unsigned i = 0; sig == SIGKILL && cgroot >= 0 && i < RECENT; i++)
            if (recent[i].cg[0] && recent[i].id == id) kill_cgroup(recent[i].cg);
        return;
    }
    kill(-p->pid, sig);
    if (sig == SIGKILL && p->cg[0] && cgroot >= 0) kill_cgroup(p->cg);
}

#include "dsec-guestsetup.h"

/* --- the loop ------------------------------------------------------------------------ */

/* The writable disk at one consistent point, for a copy of it (a fork): 1 flushes it and
 * holds every writer (FIFREEZE), 0 lets them go. Already so is no error. */
static int quiesce(char freeze) {
    if (rwfd < 0) return ENODEV;
    if (freeze) {
        sync();
        if (ioctl(rwfd, FIFREEZE, 0) < 0 && errno != EBUSY) return errno;
    } else if (ioctl(rwfd, FITHAW, 0) < 0 && errno != EINVAL) {
        return errno;
    }
    return 0;
}

static char inframe[MAX_FRAME];
static size_t inlen;

static int handle_frames(int *setup_done) {
    size_t off = 0;
    while (inlen - off >= 9) {
        char type = inframe[off];
        uint32_t id, len;
        memcpy(&id, inframe + off + 1, 4);
        memcpy(&len, inframe + off + 5, 4);
        if (len > MAX_FRAME - 9) return -1; /* not our protocol: nothing sane to do */
        if (inlen - off < 9 + len) break;
        const char *body = inframe + off + 9;
        switch (type) {
        case 'M':
            if (*setup_done) { send_value('m', id, EALREADY); break; }
            {
                int e = handle_setup(body, len);
                if (e == 0) *setup_done = 1;
                send_value('m', id, e);
            }
            break;
        case 'S':
            if (*setup_done) handle_spawn(id, body, len);
            else send_value('F', id, EAGAIN);
            break;
        case 'I': handle_stdin(id, body, len); break;
        case 'K': handle_kill(id, body, len); break;
        case 'P': send_value('p', id, 0); break;
        case 'Q': send_value('q', id, len >= 1 ? quiesce(body[0]) : EINVAL); break;
        case 'Z': send_value('z', id, *setup_done ? handle_resumed(body, len) : EAGAIN); break;
        case 'U': send_value('u', id, *setup_done ? kill_all() : EAGAIN); break;
        default: break;
        }
        off += 9 + len;
    }
    memmove(inframe, inframe + off, inlen - off);
    inlen -= off;
    return 0;
}

int main(void) {
    if (getpid() != 1) {
        fprintf(stderr, "dsec-guest is the init of a dsec microVM\n");
        return 2;
    }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    signal(SIGPIPE, SIG_IGN);
    ns_after_proc = level_proc;
    mkdir("/dev", 0755);
    mkdir("/proc", 0555);
    mkdir("/sys", 0555);
    if (mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755") < 0) die("mount /dev");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) die("mount /proc");
    if (mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) die("mount /sys");
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    for (int i = 0; i < 3; i++) dup2(null, i);
    if (load_modules() < 0) die("load modules");
    for (int tries = 0; (port = open(PORT, O_RDWR | O_NONBLOCK | O_CLOEXEC)) < 0; tries++) {
        if (tries > 5000) die("open " PORT);
        usleep(1000);
    }
    outq = malloc(OUT_CAP);
    if (!outq) die("malloc");
    for (int i = 0; i < MAX_PROCS; i++) procs[i].in = procs[i].out = procs[i].err = -1;
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    ep = epoll_create1(EPOLL_CLOEXEC);
    if (sfd < 0 || ep < 0) die("signalfd/epoll");
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 1};
    epoll_ctl(ep, EPOLL_CTL_ADD, sfd, &ev);
    ev.data.u64 = 0;
    epoll_ctl(ep, EPOLL_CTL_ADD, port, &ev);
    send_frame('H', 0, NULL, 0);
    int setup_done = 0, host_gone = 0;
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(ep, evs, 64, host_gone ? 100 : -1);
        if (n < 0 && errno != EINTR) die("epoll_wait");
        if (host_gone) { /* the host hung up (an edge restart): look for a new one */
            host_gone = 0;
            watch(port, EPOLLIN | (outlen > outoff ? EPOLLOUT : 0), 0);
        }
        for (int i = 0; i < n; i++) {
            uint64_t key = evs[i].data.u64;
            if (key == 0) {
                if (evs[i].events & EPOLLOUT) flush_port();
                if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                    ssize_t r = read(port, inframe + inlen, sizeof inframe - inlen);
                    if (r > 0) {
                        inlen += r;
                        if (handle_frames(&setup_done) < 0) inlen = 0;
                    } else if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                        inlen = 0;
                        host_gone = 1;
                        watch(port, 0, 0);
                    }
                }
            } else if (key == 1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) > 0) {
                }
                reap();
            } else {
                struct proc *p = &procs[(key - 2) / 4];
                int which = (int)((key - 2) % 4);
                if (!p->pid) continue;
                if (which == 0) pump_input(p);
                else pump_output(p, which, 0);
                maybe_finish(p);
            }
        }
    }
}
