// Facts about this process's host that ranks exchange at bootstrap: which
// ranks share a machine (and so shared memory), and whether a peer's pid
// means anything here.
#pragma once

#include <string>

namespace pyddp {

// Ranks may share memory only on the same machine and boot: the hostname
// and the kernel's boot id, or PYDDP_HOSTID when set (for containers that
// share a kernel but not /dev/shm, or the reverse).
std::string hostId();
// This process's pid namespace: pids of ranks in other namespaces cannot
// be looked up here.
std::string pidNamespace();
// False once `pid` has exited (a zombie counts as exited: its parent may
// not have reaped it yet).
bool processAlive(int pid);

} // namespace pyddp
