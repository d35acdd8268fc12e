// What the process as a whole is going through, which every group's engine
// consults: fork() and interpreter exit. Both are facts about the process,
// not about any one group, so they are kept for the process, as its
// threads are.
//
// Fork. A child of fork() inherits its parent's groups as copied memory:
// their shared segments are still mapped (and still the parent's peers'),
// but none of their threads exist. Nothing the child does may touch them:
// not a collective, not a shutdown, not the destruction that a garbage
// collection or a normal exit would run (it would write the parent's failed
// flags, unlink its names and join threads that are not there). So a child
// disowns every group at once (the fork handler below): an engine records
// the fork generation it was made in, refuses calls from a later one, and
// is never destroyed there (the child keeps a reference it never drops).
//
// Exit. pyddp's exit hook shuts the live engines down before the
// interpreter finalises, which wakes every thread waiting in a collective.
// A thread that takes the GIL back once finalisation has begun is ended
// inside that call (pthread_exit), and ending it from a destructor or a
// noexcept frame aborts the process. So once the hook began, a thread
// leaving a pyddp call for a caller that may take the GIL (pyddp's
// bindings, torch's) parks instead: it sleeps until the process ends.
// pyddp's own threads (workers, progress threads) never park: the hook
// joins them.
#pragma once

#include <cstdint>
#include <string>

namespace pyddp {
namespace process {

// 0 in a process that never forked; one more in each child of a fork().
uint64_t forkGeneration();

// Runs `child` in every child of a fork() (on its one thread, before fork()
// returns there), after `prepare` and before `parent` (in the parent, after
// fork() returned): a process-wide registry takes its lock in `prepare` so
// that no child inherits it held, and disowns what it holds in `child`.
// Handlers run in the order they were added (prepare in reverse).
void onFork(void (*prepare)(), void (*parent)(), void (*child)());

// Called by pyddp's exit hook on the thread that runs it, before it shuts
// the engines down.
void beginExit();
// On a thread other than the exit hook's, once it began, and not one of
// pyddp's own: sleeps until the process ends. Otherwise returns at once.
void parkIfExiting();
// Marks the calling thread as one of pyddp's own, which never parks.
void markOwnThread();

// Parks (parkIfExiting) when it goes out of scope, returning or throwing:
// the last thing a pyddp entry point does before its caller runs again.
struct ExitGate {
  ExitGate() = default;
  ExitGate(const ExitGate&) = delete;
  ExitGate& operator=(const ExitGate&) = delete;
  ~ExitGate() { parkIfExiting(); }
};

} // namespace process
} // namespace pyddp
