"""Host isolation pieces: cgroups, seccomp, the OCI spec, Linux syscalls."""
