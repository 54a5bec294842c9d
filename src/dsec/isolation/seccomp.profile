# dsec seccomp profile for container sandboxes.
#
# Default action: allow. Every rule below denies one syscall, or one syscall
# with one argument pattern, and says why. One rule per line:
#
#   <action> <syscall> [arg<N> <op> <value> [<mask>]]   # why
#
# actions: eperm (fail with EPERM), enosys (fail with ENOSYS, so libc falls
# back to an older call we can filter). ops: eq, masked_eq, ne.
# Values may be decimal or 0x hex. Unknown syscall names on this kernel's
# architecture are a load error, so typos cannot silently weaken the profile.

# --- other processes: no introspection or injection ---
eperm ptrace                      # read or rewrite another process, the shim included
eperm process_vm_readv            # read another process's memory without ptrace
eperm process_vm_writev           # write another process's memory
eperm pidfd_getfd                 # steal a file descriptor (the shim's control socket) from another process
eperm kcmp                        # compare kernel objects of other processes: an info leak
eperm process_madvise             # act on another process's memory

# --- the file system tree: no mounts, no pivots ---
eperm mount                       # mount anything, e.g. procfs or a bind of a masked path
eperm umount2                     # unmount a mask and expose /proc/kcore and friends
eperm pivot_root                  # change the root of the mount namespace
eperm move_mount                  # new mount API
eperm open_tree                   # new mount API: clone a mount
eperm fsopen                      # new mount API
eperm fsconfig                    # new mount API
eperm fsmount                     # new mount API
eperm fspick                      # new mount API
eperm mount_setattr               # new mount API: change mount flags (e.g. drop read-only)
eperm open_by_handle_at           # open any inode of the file system by handle: the "shocker" escape
eperm name_to_handle_at           # produce handles for open_by_handle_at
eperm chroot                      # chroot games around a mount namespace
eperm quotactl                    # file system quota control
eperm quotactl_fd                 # file system quota control

# --- namespaces: no new ones, no joining ---
eperm unshare                     # new namespaces give fresh capabilities over new resources
eperm setns                       # join another namespace
eperm clone arg0 masked_eq 0x10000000 0x10000000   # CLONE_NEWUSER: a user namespace restores every capability inside it
eperm clone arg0 masked_eq 0x00020000 0x00020000   # CLONE_NEWNS
eperm clone arg0 masked_eq 0x20000000 0x20000000   # CLONE_NEWPID
eperm clone arg0 masked_eq 0x40000000 0x40000000   # CLONE_NEWNET
eperm clone arg0 masked_eq 0x08000000 0x08000000   # CLONE_NEWIPC
eperm clone arg0 masked_eq 0x04000000 0x04000000   # CLONE_NEWUTS
eperm clone arg0 masked_eq 0x02000000 0x02000000   # CLONE_NEWCGROUP
enosys clone3                     # flags live in memory and cannot be filtered: make libc fall back to clone
eperm prlimit64 arg0 eq 1         # the shim's (PID 1) limits: with 5 descriptors it could take no exec's stdio

# --- the kernel itself ---
eperm bpf                         # load programs into the kernel
eperm perf_event_open             # kernel profiling: side channels and a long CVE history
eperm kexec_load                  # replace the running kernel
eperm kexec_file_load             # replace the running kernel
eperm reboot                      # reboot or halt the host
eperm init_module                 # load a kernel module
eperm finit_module                # load a kernel module from a file
eperm delete_module               # unload a kernel module
eperm iopl                        # raw I/O port access
eperm ioperm                      # raw I/O port access
eperm syslog                      # read the kernel log
eperm acct                        # process accounting to a file
eperm swapon                      # host swap configuration
eperm swapoff                     # host swap configuration
eperm settimeofday                # the host clock
eperm clock_settime               # the host clock
eperm clock_adjtime               # the host clock
eperm adjtimex                    # the host clock
eperm lookup_dcookie              # kernel profiling internals
eperm userfaultfd                 # stalls kernel threads at will: a staple of race exploits
eperm personality arg0 masked_eq 0x0040000 0x0040000   # ADDR_NO_RANDOMIZE: turning off ASLR helps exploits
eperm vhangup                     # hang up the host's terminals
eperm nfsservctl                  # kernel NFS daemon control
eperm io_uring_setup              # io_uring bypasses seccomp for the operations it performs
eperm io_uring_enter              # io_uring
eperm io_uring_register           # io_uring

# --- keys: the kernel keyring is not namespaced ---
eperm keyctl                      # read or modify keys shared with the host
eperm add_key                     # add keys to a shared keyring
eperm request_key                 # ask the kernel (and host upcalls) for keys

# --- ioctls ---
eperm ioctl arg1 masked_eq 0xc0c0586d 0xffffffff   # XFS_IOC_SWAPEXT: swap extents with another file (read protected data; corrupted XFS in production)
eperm ioctl arg1 masked_eq 0x40285881 0xffffffff   # XFS_IOC_EXCHANGE_RANGE: the newer extent exchange
eperm ioctl arg1 masked_eq 0xc028660f 0xffffffff   # EXT4_IOC_MOVE_EXT: move extents between files
eperm ioctl arg1 masked_eq 0x40049409 0xffffffff   # FICLONE: share extents with another file
eperm ioctl arg1 masked_eq 0x4020940d 0xffffffff   # FICLONERANGE: share extents with another file
eperm ioctl arg1 masked_eq 0xc0189436 0xffffffff   # FIDEDUPERANGE: share extents with another file
eperm ioctl arg1 masked_eq 0x00005412 0xffffffff   # TIOCSTI: push input into a terminal another process reads
eperm ioctl arg1 masked_eq 0x0000541c 0xffffffff   # TIOCLINUX: console control
