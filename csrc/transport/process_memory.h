// Peers' memory where it lies, for the shm transport's PeerMemory: a peer's
// registered tensors mapped into this process (registered.h), and a peer's
// plain tensors copied by the kernel (cross-memory attach:
// process_vm_readv, and process_vm_writev for a broadcast's root).
//
// Whether every rank may do either is settled while the group connects,
// so that all ranks decide alike and none fails a collective on a tensor it
// cannot reach: each rank names a probe of each kind in its blob (a page of
// registered memory, a word of its memory holding a value of its choosing);
// connect() tries every peer's and stores the outcome in the rank's shared
// words (release); after the bootstrap meeting that follows, connected()
// reads every peer's (acquire).
//
// Writes into a peer (a broadcast's root writes part of each receiver's
// tensor while the receiver reads the rest). A receiver that gives up may
// hand its tensor back to its caller, who may free it: no write may land
// after that. The writer stores writing = seq (seq_cst), then loads the
// receiver's refusesWrites (seq_cst) and writes only if it is 0; it stores
// writing = 0 (release) once the system call returned. A rank that gives
// up, on every call (giving up may run on two threads, and the second must
// not return before the write either), stores refusesWrites = 1 (seq_cst),
// then loads each peer's writing (seq_cst) and waits while it is not 0 and
// the peer's process has not exited. Invariant: of the two stores, the one
// first in the single total order is seen by the other side's load, so
// either the writer does not write or the receiver waits for the write to
// end. The wait is as long as one system call of the writer's, unless it is
// stopped (a signal, a debugger): the receiver then waits with it, as its
// tensor may still be written.
//
// Reads are trusted only if, after the kernel copied the bytes, the owner's
// process (pinned by a pidfd at connect, so a reused pid never passes for
// it) has not exited and has not given up on this collective.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/blob.h"
#include "common/types.h"
#include "transport/registered.h"
#include "transport/shm_control.h"

namespace pyddp {
namespace shm {

// The words of the protocols above in each rank's segment: written by
// their owner, read by its peers.
struct alignas(kCacheLine) ProcessWords {
  // 1 once this rank has mapped every peer's registered memory probe, 0 if
  // it could not.
  std::atomic<uint32_t> mapsRegistered;
  // 1 once this rank has read every peer's cross-memory attach probe and
  // written it back, 0 if it could not.
  std::atomic<uint32_t> readsProcesses;
  // The collective whose write into a peer this rank is in, 0 = none.
  Counter writing;
  // 1 once this rank gave up (no peer may write into it), 0 before.
  Counter refusesWrites;
};
static_assert(std::is_standard_layout_v<ProcessWords>);
static_assert(offsetof(ProcessWords, mapsRegistered) == 0 &&
              offsetof(ProcessWords, readsProcesses) == 4 &&
              offsetof(ProcessWords, writing) == 64 &&
              offsetof(ProcessWords, refusesWrites) == 128 && sizeof(ProcessWords) == 192);

class ProcessMemory {
 public:
  // `control` says who the peers are and why they gave up.
  ProcessMemory(int rank, int worldSize, CmaReads cma, const ControlPlane& control);
  ~ProcessMemory();
  ProcessMemory(const ProcessMemory&) = delete;
  ProcessMemory& operator=(const ProcessMemory&) = delete;

  // Bootstrap, beside the control plane's: the probes made and named in
  // `blob`; every peer's tried (`words`: every rank's, this rank's
  // writable), the outcomes stored; then every rank's read and agreed.
  void setup(BlobWriter& blob);
  void connect(const std::vector<BlobReader>& blobs, std::vector<ProcessWords*> words);
  void connected();

  // Agreed while connecting: "" when every rank mapped a page of registered
  // memory of every peer.
  const std::string& whyNotMapRegistered() const { return registeredRefusal_; }
  // Agreed while connecting: "" when every rank read every peer's probe
  // word through process_vm_readv and wrote it back through
  // process_vm_writev.
  const std::string& whyNotReadProcesses() const { return processRefusal_; }
  const void* registeredTensor(int rank, const registered::Ref& ref, size_t bytes);
  void readProcess(int rank, void* dst, uint64_t address, size_t bytes);
  void writeProcess(int rank, uint64_t address, const void* src, size_t bytes);
  // The second half of giving up: no peer starts a write into this process
  // from now on, and none is under way on return (protocol above).
  void refuseWrites();

  // Copies made by readProcess() and writeProcess() (one that wrote any
  // byte) in this process so far: tests see through them which path a
  // collective took.
  static uint64_t processReads();
  static uint64_t processWrites();
  // For tests of the protocol of writes into a peer: writeProcess() sleeps
  // `beforeCheck` between storing writing and loading the peer's
  // refusesWrites, and `beforeCopy` after it (both 0 outside tests).
  static void pauseWrites(std::chrono::milliseconds beforeCheck,
                          std::chrono::milliseconds beforeCopy);

 private:
  // Why this rank cannot read every peer's probe word through the kernel
  // and write it back ("" if it can), pinning each peer's process on the
  // way.
  std::string whyNotReadPeers(const std::vector<BlobReader>& blobs);
  std::string whyNotMapPeers(const std::vector<BlobReader>& blobs) const;
  // Sets `refusal` (if "") naming the first rank whose words say it could
  // not pass a probe (`succeeded` != 1): it "cannot `what`".
  void agreeOnProbes(std::atomic<uint32_t> ProcessWords::*succeeded, const char* what,
                     std::string& refusal) const;
  // Fails, naming the first cause, unless a copy through the kernel from
  // (or, `write`, into) rank `rank`'s process of `bytes` copied them all
  // (`done`; `err`: errno) while the rank was alive and had not given up.
  void checkCopied(int rank, bool write, size_t done, size_t bytes, int err) const;
  // Whether rank `rank`'s pinned process has not exited.
  bool peerStillIn(int rank) const;

  const int rank_;
  const int worldSize_;
  const CmaReads cma_;
  const ControlPlane& control_;
  std::vector<ProcessWords*> words_;  // by rank, once connected
  std::vector<int> pidfds_;           // by rank: the peer's process, pinned; -1: none
  std::vector<registered::PeerMaps> tensors_;  // by rank: its registered tensors mapped here
  // A page of registered memory the peers map while connecting; released
  // once every rank has connected.
  void* probe_ = nullptr;
  // A word the peers read through process_vm_readv (and write back
  // unchanged) while connecting, to learn whether the kernel lets them; it
  // holds a value of this rank's choosing, named in the blob.
  uint64_t processProbe_ = 0;
  std::string registeredRefusal_ = "the group is not connected";
  std::string processRefusal_ = "the group is not connected";
};

} // namespace shm
} // namespace pyddp
