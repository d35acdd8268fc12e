#include "transport/process_memory.h"

#include <poll.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <utility>

#include "common/check.h"

namespace pyddp {
namespace shm {
namespace {

std::string errnoText() {
  return std::strerror(errno);
}

// Process-wide, as the copies they count: tests read them.
std::atomic<uint64_t> processReadsCount{0};
std::atomic<uint64_t> processWritesCount{0};
std::atomic<int64_t> pauseBeforeCheckMs{0};
std::atomic<int64_t> pauseBeforeCopyMs{0};

void pauseFor(const std::atomic<int64_t>& ms) {
  const int64_t n = ms.load(std::memory_order_relaxed);
  if (n > 0) std::this_thread::sleep_for(std::chrono::milliseconds(n));
}

// Copies `bytes` between `local` here and `remote` in process `pid` through
// the kernel, in as many calls as it takes (a call may copy less): the
// bytes copied, and the errno of the call that failed (0 if none did, or
// one copied nothing).
std::pair<size_t, int> copyThroughKernel(int pid, bool write, char* local, char* remote,
                                         size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    iovec here{local + done, bytes - done};
    iovec there{remote + done, bytes - done};
    const ssize_t got = write ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                              : process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (got <= 0) return {done, got < 0 ? errno : 0};
    done += static_cast<size_t>(got);
  }
  return {done, 0};
}

registered::Ref probeOf(const BlobReader& b) {
  return registered::Ref{b.get<uint64_t>("probe_serial"), b.get<uint64_t>("probe_inode"),
                         b.get<uint64_t>("probe_bytes"), 0, b.get<int>("pid"),
                         b.get<int32_t>("probe_fd")};
}

} // namespace

ProcessMemory::ProcessMemory(int rank, int worldSize, CmaReads cma, const ControlPlane& control)
    : rank_(rank), worldSize_(worldSize), cma_(cma), control_(control),
      pidfds_(worldSize, -1), tensors_(worldSize) {}

ProcessMemory::~ProcessMemory() {
  if (probe_) registered::release(probe_);
  for (int fd : pidfds_) {
    if (fd >= 0) close(fd);
  }
}

void ProcessMemory::setup(BlobWriter& blob) {
  processProbe_ = std::random_device()() | 1;
  blob.put("process_probe", reinterpret_cast<uintptr_t>(&processProbe_))
      .put("process_token", processProbe_);
  // A page of registered memory for the peers to try (connect()): a rank
  // that cannot make one still connects, and the group reads through
  // staging.
  registered::Ref probe{};
  try {
    probe_ = registered::allocate(1);
    probe = registered::locate(probe_, 1);
  } catch (const std::exception& e) {
    registeredRefusal_ = "rank " + std::to_string(rank_) + " cannot make registered memory: " +
        e.what();
  }
  blob.put("probe_serial", probe.serial)
      .put("probe_inode", probe.inode)
      .put("probe_bytes", probe.mapBytes)
      .put("probe_fd", probe.fd);
}

std::string ProcessMemory::whyNotMapPeers(const std::vector<BlobReader>& blobs) const {
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    if (!control_.pidVisible(peer)) {
      return "rank " + std::to_string(peer) + " runs in another pid namespace";
    }
    const registered::Ref probe = probeOf(blobs[peer]);
    if (probe.serial == 0) {
      return "rank " + std::to_string(peer) + " cannot make registered memory";
    }
    std::string why = registered::whyNotMappable(probe, control_.pid(peer), peer);
    if (!why.empty()) return why;
  }
  return "";
}

std::string ProcessMemory::whyNotReadPeers(const std::vector<BlobReader>& blobs) {
  if (cma_ == CmaReads::Never) return "cma (PYDDP_CMA) is never";
  for (int peer = 0; peer < worldSize_; ++peer) {
    if (peer == rank_) continue;
    const int pid = control_.pid(peer);
    const std::string who = "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ")";
    if (!control_.pidVisible(peer)) return who + " runs in another pid namespace";
    pidfds_[peer] = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (pidfds_[peer] < 0) return "cannot pin " + who + " (pidfd_open): " + errnoText();
    const auto address = blobs[peer].get<uint64_t>("process_probe");
    const auto expected = blobs[peer].get<uint64_t>("process_token");
    uint64_t token = 0;
    iovec local{&token, sizeof token};
    iovec remote{reinterpret_cast<void*>(address), sizeof token};
    const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got != sizeof token) {
      return "process_vm_readv of " + who + " failed: " +
          (got < 0 ? errnoText() : "it read " + std::to_string(got) + " bytes of 8") +
          " (the kernel lets a process read another's memory only where it could ptrace it: "
          "the same user, and kernel.yama.ptrace_scope 0 or a container that allows it)";
    }
    if (token != expected) {
      return "process_vm_readv of " + who + " read another value than its blob names";
    }
    // And back, as a broadcast's root writes its peers' tensors: the kernel
    // checks the same rights, but a seccomp filter may let reads through
    // and not writes. The same value: a peer reading the word meanwhile
    // sees no change.
    const ssize_t put = process_vm_writev(pid, &local, 1, &remote, 1, 0);
    if (put != sizeof token) {
      return "process_vm_writev of " + who + " failed: " +
          (put < 0 ? errnoText() : "it wrote " + std::to_string(put) + " bytes of 8");
    }
  }
  return "";
}

void ProcessMemory::connect(const std::vector<BlobReader>& blobs,
                            std::vector<ProcessWords*> words) {
  words_ = std::move(words);
  if (probe_) registeredRefusal_ = whyNotMapPeers(blobs);
  words_[rank_]->mapsRegistered.store(registeredRefusal_.empty() ? 1 : 0,
                                      std::memory_order_release);
  processRefusal_ = whyNotReadPeers(blobs);
  words_[rank_]->readsProcesses.store(processRefusal_.empty() ? 1 : 0,
                                      std::memory_order_release);
}

void ProcessMemory::connected() {
  // Every rank has tried every probe: the group maps registered tensors,
  // and reads plain ones through the kernel, only if all could.
  agreeOnProbes(&ProcessWords::mapsRegistered, "map every peer's registered memory",
                registeredRefusal_);
  agreeOnProbes(&ProcessWords::readsProcesses, "read every peer's memory through the kernel",
                processRefusal_);
  registered::release(probe_);
  probe_ = nullptr;
}

void ProcessMemory::agreeOnProbes(std::atomic<uint32_t> ProcessWords::*succeeded,
                                  const char* what, std::string& refusal) const {
  for (int peer = 0; peer < worldSize_ && refusal.empty(); ++peer) {
    if ((words_[peer]->*succeeded).load(std::memory_order_acquire) != 1) {
      refusal = "rank " + std::to_string(peer) + " cannot " + what;
    }
  }
}

const void* ProcessMemory::registeredTensor(int rank, const registered::Ref& ref,
                                            size_t bytes) {
  return tensors_[rank].map(ref, bytes, control_.pid(rank), rank);
}

uint64_t ProcessMemory::processReads() {
  return processReadsCount.load(std::memory_order_relaxed);
}

uint64_t ProcessMemory::processWrites() {
  return processWritesCount.load(std::memory_order_relaxed);
}

void ProcessMemory::pauseWrites(std::chrono::milliseconds beforeCheck,
                                std::chrono::milliseconds beforeCopy) {
  pauseBeforeCheckMs.store(beforeCheck.count(), std::memory_order_relaxed);
  pauseBeforeCopyMs.store(beforeCopy.count(), std::memory_order_relaxed);
}

void ProcessMemory::readProcess(int rank, void* dst, uint64_t address, size_t bytes) {
  // The kernel copies from the peer's page tables as they are during the
  // call: a peer that exited (its pid then names nothing, or, once reaped,
  // another process: hence the pidfd) or unmapped the range fails it.
  const auto [done, err] = copyThroughKernel(control_.pid(rank), /*write=*/false,
                                             static_cast<char*>(dst),
                                             reinterpret_cast<char*>(address), bytes);
  // A peer releases its tensor only after the collective's next meeting
  // (which this rank has not reached), or after it gave up or died: the
  // bytes read are its tensor's unless one of those happened first, and a
  // failed read is named by that first.
  checkCopied(rank, /*write=*/false, done, bytes, err);
  processReadsCount.fetch_add(1, std::memory_order_relaxed);
}

void ProcessMemory::writeProcess(int rank, uint64_t address, const void* src, size_t bytes) {
  auto& writing = words_[rank_]->writing.value;
  // announce the write, then look whether the receiver still takes it
  // (protocol above)
  writing.store(control_.current().seq, std::memory_order_seq_cst);
  pauseFor(pauseBeforeCheckMs);
  if (words_[rank]->refusesWrites.value.load(std::memory_order_seq_cst) != 0) {
    writing.store(0, std::memory_order_release);
    control_.failIfGaveUp(rank, std::numeric_limits<uint64_t>::max());
    PYDDP_CHECK_COMM(false, "rank ", rank, " gave up while rank ", rank_,
                     " was to write its tensor in ", control_.currentCall());
  }
  pauseFor(pauseBeforeCopyMs);
  const auto [done, err] = copyThroughKernel(
      control_.pid(rank), /*write=*/true, const_cast<char*>(static_cast<const char*>(src)),
      reinterpret_cast<char*>(address), bytes);
  writing.store(0, std::memory_order_release);
  if (done > 0) processWritesCount.fetch_add(1, std::memory_order_relaxed);
  checkCopied(rank, /*write=*/true, done, bytes, err);
}

void ProcessMemory::refuseWrites() {
  if (words_.empty()) return;
  words_[rank_]->refusesWrites.value.store(1, std::memory_order_seq_cst);
  for (int k = 0; k < worldSize_; ++k) {
    if (k == rank_) continue;
    const auto& writing = words_[k]->writing.value;
    Backoff backoff;
    while (writing.load(std::memory_order_seq_cst) != 0 && peerStillIn(k)) backoff.pause();
  }
}

void ProcessMemory::checkCopied(int rank, bool write, size_t done, size_t bytes,
                                int err) const {
  const int pid = control_.pid(rank);
  // ESRCH: the process has no memory any more (its main thread exited,
  // though a pidfd may not say so until its last thread has).
  PYDDP_CHECK_COMM(err != ESRCH && peerStillIn(rank), "rank ", rank, " (pid ", pid,
                   ") exited while rank ", rank_, (write ? " wrote" : " read"),
                   " its tensor in ", control_.currentCall());
  control_.failIfGaveUp(rank, control_.current().seq);
  PYDDP_CHECK_COMM(done == bytes, "rank ", rank_, ": ", control_.currentCall(), ": ",
                   (write ? "process_vm_writev" : "process_vm_readv"), " of ", bytes - done,
                   (write ? " bytes into rank " : " bytes of rank "), rank, "'s tensor (pid ",
                   pid, ") failed: ", err != 0 ? std::strerror(err) : "no progress");
}

bool ProcessMemory::peerStillIn(int rank) const {
  pollfd p{pidfds_[rank], POLLIN, 0};
  int ready;
  do {
    ready = poll(&p, 1, 0);
  } while (ready < 0 && errno == EINTR);
  // readable once the process has exited
  return ready <= 0 || (p.revents & POLLIN) == 0;
}

} // namespace shm
} // namespace pyddp
