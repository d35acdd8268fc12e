#include "testing/sendrecv_sim.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "algorithms/collectives.h"
#include "common/check.h"
#include "transport/sendrecv_ring.h"

namespace pyddp {
namespace sendrecv {
namespace {

// The ranks' links and one MAX all-reduce, under one mutex. Operations on
// link r (rank r -> rank r+1) are matched by order: send #k with receive
// #k. Whichever of the two is posted second checks the sizes and copies.
class Network {
 public:
  Network(int n, std::chrono::milliseconds timeout) : n_(n), timeout_(timeout), links_(n) {}

  void group(int rank, const void* send, size_t sendBytes, void* recv, size_t recvBytes) {
    std::unique_lock<std::mutex> lock(mu_);
    // NCCL reads the send buffer while the same group writes the receive
    // buffer: they must not overlap.
    const auto* s0 = static_cast<const char*>(send);
    const auto* r0 = static_cast<const char*>(recv);
    if (sendBytes && recvBytes && s0 < r0 + recvBytes && r0 < s0 + sendBytes) {
      failLocked(c10::str("pyddp: rank ", rank, " posted a group whose send (", sendBytes,
                          " bytes) overlaps its receive (", recvBytes, " bytes)"));
      throwFailure();
    }
    Op* s = sendBytes ? post(rank, /*isSend=*/true, const_cast<void*>(send), sendBytes) : nullptr;
    Op* r = recvBytes ? post((rank + n_ - 1) % n_, /*isSend=*/false, recv, recvBytes) : nullptr;
    cv_.notify_all();
    const bool done = cv_.wait_until(lock, Clock::now() + timeout_, [&] {
      return !failure_.empty() || ((!s || s->done) && (!r || r->done));
    });
    if ((!s || s->done) && (!r || r->done)) return;
    if (!done) {
      failLocked(c10::str("pyddp: rank ", rank, " deadlocked: its group (",
                          s ? "send to the right" : "", s && r ? " and " : "",
                          r ? "receive from the left" : "", ") did not complete within ",
                          timeout_.count(), " ms"));
    }
    throwFailure();
  }

  DescWords allReduceMax(int rank, const DescWords& words) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    for (int i = 0; i < kDescWords; ++i) {
      acc_[i] = arrived_ == 0 ? words[i] : std::max(acc_[i], words[i]);
    }
    if (++arrived_ == n_) {
      result_ = acc_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    const bool done = cv_.wait_until(lock, Clock::now() + timeout_, [&] {
      return !failure_.empty() || generation_ != generation;
    });
    if (generation_ != generation) return result_;
    if (!done) {
      failLocked(c10::str("pyddp: rank ", rank, " waited ", timeout_.count(),
                          " ms in the descriptor check"));
    }
    throwFailure();
  }

  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    failLocked(why);
  }

 private:
  struct Op {
    void* data;
    size_t bytes;
    bool done = false;
  };
  struct Link {
    std::vector<std::unique_ptr<Op>> sends, recvs;
  };

  // The failure as this rank's error; the message already names its rank.
  [[noreturn]] void throwFailure() const {
    C10_THROW_ERROR(DistBackendError, failure_);
  }

  // The first failure wins; every wait ends. mu_ held.
  void failLocked(const std::string& why) {
    if (failure_.empty()) failure_ = why;
    cv_.notify_all();
  }

  Op* post(int link, bool isSend, void* data, size_t bytes) {
    Link& l = links_[link];
    auto& mine = isSend ? l.sends : l.recvs;
    auto& theirs = isSend ? l.recvs : l.sends;
    mine.push_back(std::make_unique<Op>(Op{data, bytes}));
    const size_t k = mine.size() - 1;
    if (theirs.size() > k) {
      Op& send = isSend ? *mine[k] : *theirs[k];
      Op& recv = isSend ? *theirs[k] : *mine[k];
      if (send.bytes != recv.bytes) {
        failLocked(c10::str("pyddp: rank ", link, "'s send #", k, " of ", send.bytes,
                            " bytes met rank ", (link + 1) % n_, "'s receive #", k, " of ",
                            recv.bytes, " bytes"));
      } else {
        std::memcpy(recv.data, send.data, send.bytes);
      }
      send.done = recv.done = true;
    }
    return mine[k].get();
  }

  const int n_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Link> links_;
  std::string failure_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  DescWords acc_{}, result_{};
};

class SimOps final : public SendRecvOps {
 public:
  SimOps(Network& net, int rank) : net_(net), rank_(rank) {}
  void post(const void* send, size_t sendBytes, void* recv, size_t recvBytes) override {
    net_.group(rank_, send, sendBytes, recv, recvBytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (dst != src) std::memcpy(dst, src, bytes);
  }
  void toPartial(const kernels::ReduceSpec& spec, void* dst, const void* src,
                 size_t count) override {
    kernels::toPartial(spec, dst, src, count);
  }
  void reducePartial(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                     const void* local, size_t count) override {
    kernels::reducePartial(spec, dst, partial, kernels::Incoming::Partials, local, count);
  }
  void reduceFinal(const kernels::ReduceSpec& spec, void* dst, const void* partial,
                   const void* local, size_t count) override {
    kernels::reduceFinal(spec, dst, nullptr, partial, kernels::Incoming::Partials, local, count);
  }

 private:
  Network& net_;
  const int rank_;
};

class SimTransport final : public Transport, private LocalOps {
 public:
  SimTransport(Network& net, int rank, size_t pieceBytes)
      : net_(net),
        rank_(rank),
        ops_(net, rank),
        recvScratch_(pieceBytes),
        sendScratch_(pieceBytes),
        ring_(ops_, pieceBytes, recvScratch_.data(), sendScratch_.data()) {}

  const char* name() const override { return "sendrecv-sim"; }
  std::string setup() override { return ""; }
  std::string whyNotConnect(int, const std::string&) const override { return ""; }
  void connect(const std::vector<std::string>&) override {}
  void connected() override {}
  void enter(const CollectiveDesc& desc, Deadline) override {
    checkSame(desc, net_.allReduceMax(rank_, encodeWords(desc)), rank_);
  }
  RingLink& ring() override { return ring_; }
  LocalOps& local() override { return *this; }
  PeerMemory* peerMemory() override { return nullptr; }
  void abandon(const std::string& why) override { net_.fail(why); }
  void abort() override { net_.fail(c10::str("pyddp: rank ", rank_, " aborted")); }

  SendRecvRing& sendRecvRing() { return ring_; }

 private:
  void copy(void* dst, const void* src, size_t bytes) override {
    if (dst != src && bytes) std::memcpy(dst, src, bytes);
  }
  void reduceN(const kernels::ReduceSpec& spec, void* dst, const void* const* src, int nsrc,
               size_t count) override {
    kernels::reduceN(spec, dst, src, nsrc, count);
  }

  Network& net_;
  const int rank_;
  SimOps ops_;
  std::vector<char> recvScratch_, sendScratch_;
  SendRecvRing ring_;
};

void runRank(SimTransport& t, const CollectiveDesc& desc, const kernels::ReduceSpec& spec,
             const void* in, void* out, int rank, int n, std::chrono::milliseconds timeout) {
  const algorithms::Call call{t, desc, Deadline::after(timeout), rank, n};
  const size_t count = desc.count;
  const size_t es = elementSize(desc.dtype);
  switch (desc.kind) {
    case CollectiveKind::AllReduce:
      algorithms::ringAllReduce(call, spec, in, out, count);
      break;
    case CollectiveKind::AllGather: {
      std::vector<void*> blocks(n);
      for (int b = 0; b < n; ++b) blocks[b] = static_cast<char*>(out) + b * count * es;
      algorithms::ringAllGather(call, desc.dtype, in, blocks, count);
      break;
    }
    case CollectiveKind::ReduceScatter: {
      std::vector<const void*> blocks(n);
      for (int b = 0; b < n; ++b) blocks[b] = static_cast<const char*>(in) + b * count * es;
      algorithms::ringReduceScatter(call, spec, blocks, out, count);
      break;
    }
    case CollectiveKind::Broadcast:
      algorithms::chainBroadcast(call, out, count * es, desc.root);
      break;
    case CollectiveKind::Barrier:
      algorithms::barrier(call);
      break;
    default:
      PYDDP_CHECK_VALUE(false, "the send/recv simulation has no ring algorithm for ",
                        toString(desc.kind));
  }
}

} // namespace

std::vector<std::string> simulateRing(const std::vector<CollectiveDesc>& descs,
                                      const std::vector<kernels::ReduceSpec>& specs,
                                      const std::vector<const void*>& inputs,
                                      const std::vector<void*>& outputs, size_t pieceBytes,
                                      int repeats, bool flushAfter,
                                      std::chrono::milliseconds timeout) {
  const int n = static_cast<int>(descs.size());
  PYDDP_CHECK_VALUE(n >= 1 && specs.size() == descs.size() && inputs.size() == descs.size() &&
                        outputs.size() == descs.size(),
                    "simulateRing: one desc, spec, input and output per rank");
  Network net(n, timeout);
  std::vector<std::unique_ptr<SimTransport>> transports;
  for (int r = 0; r < n; ++r) {
    transports.push_back(std::make_unique<SimTransport>(net, r, pieceBytes));
  }
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        for (int i = 0; i < repeats; ++i) {
          CollectiveDesc desc = descs[r];
          desc.seq += i;
          runRank(*transports[r], desc, specs[r], inputs[r], outputs[r], r, n, timeout);
          if (flushAfter) transports[r]->sendRecvRing().flush();
          PYDDP_CHECK(!transports[r]->sendRecvRing().sendPending(), "rank ", r, " finished ",
                      toString(desc.kind), " #", desc.seq, " with a send still pending: "
                      "SendRecvRing::flush() was not called");
        }
      } catch (const std::exception& e) {
        errors[r] = messageOf(e);
        net.fail(errors[r]);
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

} // namespace sendrecv
} // namespace pyddp
