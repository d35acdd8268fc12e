// The _testing submodule of pyddp._C: pure helpers (schedules, kernels,
// the cuda_ipc wait decision, the send/recv ring over simulated ranks) that
// pyddp's own tests call. Not a public API; a build with
// PYDDP_BUILD_TESTING=0 leaves this directory out.
#include "testing/bind.h"

#include <pybind11/stl.h>
#include <sys/stat.h>
#include <torch/python.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>

#include "algorithms/schedule.h"
#include "algorithms/select.h"
#include "backend/layout.h"
#include "backend/cma_chooser.h"
#include "backend/torch_backend.h"
#include "backend/torch_types.h"
#include "common/blob.h"
#include "common/check.h"
#include "common/descriptor.h"
#include "kernels/cpu.h"
#include "kernels/emulate.h"
#include "kernels/half_cpu.h"
#include "testing/sendrecv_sim.h"
#include "device/programs.h"
#include "transport/shm.h"
#include "transport/shm_segment.h"
#include "transport/slot_stores.h"
#include "transport/tag_matcher.h"

#ifdef PYDDP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda.h"
#endif

namespace py = pybind11;

namespace pyddp {
namespace testing {
namespace {

DataType dtypeOf(const at::Tensor& t) {
  const auto d = dataTypeOf(t.scalar_type());
  PYDDP_CHECK_TYPE(d.has_value(), "unsupported dtype ", t.scalar_type());
  return *d;
}

// The value of the enum E, up to `last`, that toString() names `name`.
template <typename E>
E named(const std::string& name, E last, const char* what) {
  for (int k = 0; k <= static_cast<int>(last); ++k) {
    if (name == toString(static_cast<E>(k))) return static_cast<E>(k);
  }
  PYDDP_CHECK_VALUE(false, "unknown ", what, " '", name, "'");
}

CollectiveKind kindNamed(const std::string& name) {
  return named(name, CollectiveKind::Recv, "collective");
}

// A chooser that picks what the test says, and remembers what it was asked.
class FakeKernelChoice final : public algorithms::KernelChoice {
 public:
  explicit FakeKernelChoice(algorithms::KernelPick pick) : pick_(pick) {}
  algorithms::KernelPick peek(CollectiveKind kind, size_t bytes) const override {
    asked_ = std::make_pair(kind, bytes);
    return pick_;
  }
  const std::optional<std::pair<CollectiveKind, size_t>>& asked() const { return asked_; }

 private:
  const algorithms::KernelPick pick_;
  mutable std::optional<std::pair<CollectiveKind, size_t>> asked_;
};

// The plan of a collective whose voter took its chooser's pick `kernel`.
algorithms::Plan votedPlan(CollectiveKind kind, size_t bytes, bool kernel) {
  algorithms::Plan plan;
  plan.kind = kind;
  plan.bytes = bytes;
  plan.votes = true;
  plan.reads.kernelVote = kernel;
  return plan;
}

} // namespace

void bindTesting(py::module_& m) {
  auto t = m.def_submodule(
      "_testing", "Helpers exposed for pyddp's own tests; not a public API.");
  t.def("balanced_block", [](size_t count, int n, int b) {
    const auto r = schedule::balancedBlock(count, n, b);
    return std::make_pair(r.begin, r.count);
  });
  t.def("send_block", &schedule::sendBlock);
  t.def("recv_block", &schedule::recvBlock);
  t.def("piece", [](size_t count, size_t pieceElems, size_t p) {
    const auto r = schedule::piece(count, pieceElems, p);
    return std::make_pair(r.begin, r.count);
  });
  t.def("num_pieces", &schedule::numPieces);
  t.def("registered_maps_made", &registered::PeerMaps::mapsMade);
  t.def("process_reads", &shm::ProcessMemory::processReads);
  t.def("process_writes", &shm::ProcessMemory::processWrites);
  t.def("pause_process_writes", [](int64_t beforeCheckMs, int64_t beforeCopyMs) {
    shm::ProcessMemory::pauseWrites(std::chrono::milliseconds(beforeCheckMs),
                                   std::chrono::milliseconds(beforeCopyMs));
  });
  t.def("root_written_bytes", &schedule::rootWrittenBytes);
  t.def("kernel_piece_bytes", &schedule::kernelPieceBytes);
  t.def("kernel_scratch_bytes", &schedule::kernelScratchBytes);
  t.attr("KERNEL_SCRATCH_BYTES") = schedule::kKernelScratchBytes;
  t.def("chain_position", &schedule::chainPosition);
  // The CPU kernels over contiguous tensors; partials are float32 for half
  // types and the element type otherwise.
  auto partialLike = [](const at::Tensor& local) {
    const bool half = local.scalar_type() == at::kHalf || local.scalar_type() == at::kBFloat16;
    return at::empty(local.sizes(), local.options().dtype(half ? at::kFloat : local.scalar_type()));
  };
  // The half-type conversions of the CPU kernels: the vector ones where this
  // CPU has them, or the scalar ones.
  t.def("vector_half_conversions", &kernels::vectorHalfConversions);
  t.def("widen", [](const at::Tensor& half, bool vector) {
    const at::Tensor src = half.contiguous();
    at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kFloat));
    float* dst = out.data_ptr<float>();
    const size_t n = src.numel();
    if (src.scalar_type() == at::kHalf) {
      const auto* x = src.data_ptr<c10::Half>();
      vector ? kernels::widen(x, dst, n) : kernels::scalar::widen(x, dst, n);
    } else {
      PYDDP_CHECK_TYPE(src.scalar_type() == at::kBFloat16, "widen takes float16 or bfloat16");
      const auto* x = src.data_ptr<c10::BFloat16>();
      vector ? kernels::widen(x, dst, n) : kernels::scalar::widen(x, dst, n);
    }
    return out;
  });
  t.def("narrow", [](const at::Tensor& wide, at::Tensor out, bool vector) {
    const at::Tensor src = wide.contiguous();
    PYDDP_CHECK_TYPE(src.scalar_type() == at::kFloat, "narrow takes float32");
    PYDDP_CHECK_VALUE(out.is_contiguous() && out.numel() == src.numel(),
                      "narrow: out must be contiguous, as long as the input");
    const at::ScalarType dtype = out.scalar_type();
    const float* x = src.data_ptr<float>();
    const size_t n = src.numel();
    if (dtype == at::kHalf) {
      auto* dst = out.data_ptr<c10::Half>();
      vector ? kernels::narrow(x, dst, n) : kernels::scalar::narrow(x, dst, n);
    } else {
      PYDDP_CHECK_TYPE(dtype == at::kBFloat16, "narrow makes float16 or bfloat16");
      auto* dst = out.data_ptr<c10::BFloat16>();
      vector ? kernels::narrow(x, dst, n) : kernels::scalar::narrow(x, dst, n);
    }
    return out;
  });
  // The instruction sets of the loops: which this CPU runs, and a switch
  // that makes the kernels below use another (tests cover each).
  py::enum_<kernels::LoopIsa>(t, "LoopIsa")
      .value("BASELINE", kernels::LoopIsa::Baseline)
      .value("AVX2", kernels::LoopIsa::Avx2);
  t.def("supported_loop_isas", &kernels::supportedLoopIsas);
  t.def("loop_isa", &kernels::loopIsa);
  t.def("use_loop_isa", &kernels::useLoopIsa);
  t.def("to_partial", [=](at::Tensor local) {
    auto out = partialLike(local);
    kernels::toPartial({dtypeOf(local), RedOp::Sum, 1}, out.data_ptr(), local.data_ptr(),
                       local.numel());
    return out;
  });
  // `incoming` holds partials, or elements when `elements` (a ring's first
  // hop as shm sends it).
  auto form = [](bool elements) {
    return elements ? kernels::Incoming::Elements : kernels::Incoming::Partials;
  };
  t.def("reduce_partial",
        [=](RedOp op, int worldSize, at::Tensor incoming, at::Tensor local, bool elements) {
          auto out = partialLike(local);
          kernels::reducePartial({dtypeOf(local), op, worldSize}, out.data_ptr(),
                                 incoming.data_ptr(), form(elements), local.data_ptr(),
                                 local.numel());
          return out;
        },
        py::arg("op"), py::arg("world_size"), py::arg("incoming"), py::arg("local"),
        py::kw_only(), py::arg("elements") = false);
  t.def("reduce_final",
        [=](RedOp op, int worldSize, at::Tensor incoming, at::Tensor local, bool elements) {
          auto out = at::empty_like(local), out2 = at::empty_like(local);
          kernels::reduceFinal({dtypeOf(local), op, worldSize}, out.data_ptr(), out2.data_ptr(),
                               incoming.data_ptr(), form(elements), local.data_ptr(),
                               local.numel());
          return std::make_pair(out, out2);
        },
        py::arg("op"), py::arg("world_size"), py::arg("incoming"), py::arg("local"),
        py::kw_only(), py::arg("elements") = false);
  // The slot store chooser, fed synthetic times; and the streaming copy
  // over byte tensors, from srcOffset into dstOffset bytes in (every
  // alignment of its head can be reached).
  py::class_<SlotStoreChooser>(t, "SlotStoreChooser")
      .def(py::init<SlotStores, size_t, double>(), py::arg("mode"),
           py::arg("min_chosen_bytes") = SlotStoreChooser::kMinChosenBytes,
           py::arg("streaming_advantage") = SlotStoreChooser::kStreamingAdvantage)
      .def("next",
           [](SlotStoreChooser& c, size_t bytes, bool local) {
             const auto pick = c.next(bytes, local);
             return std::make_pair(pick.streaming, pick.timed);
           })
      .def("observe", &SlotStoreChooser::observe)
      .def("prefers_streaming", &SlotStoreChooser::prefersStreaming)
      .def("cached_ns_per_byte", &SlotStoreChooser::cachedNsPerByte)
      .def("streaming_ns_per_byte", &SlotStoreChooser::streamingNsPerByte)
      .def_readonly_static("MIN_CHOSEN_BYTES", &SlotStoreChooser::kMinChosenBytes)
      .def_readonly_static("SAMPLE_EVERY", &SlotStoreChooser::kSampleEvery)
      .def_readonly_static("EXPLORE_EVERY", &SlotStoreChooser::kExploreEvery)
      .def_readonly_static("STREAMING_ADVANTAGE", &SlotStoreChooser::kStreamingAdvantage)
      .def_readonly_static("MIN_CHOSEN_STAGED_BYTES", &SlotStoreChooser::kMinChosenStagedBytes)
      .def_readonly_static("STAGED_STREAMING_ADVANTAGE",
                           &SlotStoreChooser::kStagedStreamingAdvantage)
      .def_readonly_static("WARMUP_WRITES", &SlotStoreChooser::kWarmupWrites);
  py::class_<CmaChooser>(t, "CmaChooser")
      .def(py::init<CmaReads>())
      .def("peek",
           [](const CmaChooser& c, const std::string& kind, size_t bytes) {
             const auto pick = c.peek(kindNamed(kind), bytes);
             return std::make_pair(pick.kernel, pick.timed);
           })
      .def(
          "record",
          [](CmaChooser& c, const std::string& kind, size_t bytes, bool kernel,
             std::optional<double> ns) { c.record(votedPlan(kindNamed(kind), bytes, kernel), ns); },
          py::arg("kind"), py::arg("bytes"), py::arg("kernel"), py::arg("ns") = py::none())
      .def("observe",
           [](CmaChooser& c, const std::string& kind, size_t bytes, bool kernel, double ns) {
             c.observe(kindNamed(kind), bytes, kernel, ns);
           })
      .def("prefers_kernel",
           [](CmaChooser& c, const std::string& kind, size_t bytes) {
             return c.prefersKernel(kindNamed(kind), bytes);
           })
      .def_readonly_static("EXPLORE_EVERY", &CmaChooser::kExploreEvery)
      .def_readonly_static("EXPLORE_RUN", &CmaChooser::kExploreRun)
      .def_readonly_static("FIRST_EXPLORE", &CmaChooser::kFirstExplore)
      .def_readonly_static("WINDOW", &CmaChooser::kWindow)
      .def_readonly_static("KERNEL_ADVANTAGE", &CmaChooser::kKernelAdvantage);
  t.attr("has_streaming_stores") = kernels::kHasStreamingStores;
  t.def("streaming_copy", [](at::Tensor dst, const at::Tensor& src, size_t dstOffset,
                             size_t srcOffset, size_t bytes) {
    PYDDP_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous() &&
                          dst.scalar_type() == at::kByte && src.scalar_type() == at::kByte &&
                          dstOffset + bytes <= static_cast<size_t>(dst.numel()) &&
                          srcOffset + bytes <= static_cast<size_t>(src.numel()),
                      "streaming_copy: contiguous uint8 tensors that hold the ranges");
    kernels::streamingCopy(dst.data_ptr<uint8_t>() + dstOffset,
                           src.data_ptr<uint8_t>() + srcOffset, bytes);
  });
  // Creates one shm segment as a group's bootstrap does, reports its name and
  // permission bits, and destroys it without ever connecting.
  t.def("probe_shm_segment", [] {
    shm::ShmTransport transport(0, 2, GroupOptions::fromEnv());
    const std::string name = BlobReader(transport.setup(), "the shm blob").str("segment");
    struct stat st {};
    PYDDP_CHECK(stat(("/dev/shm" + name).c_str(), &st) == 0, "segment ", name, " not found");
    return std::make_pair(name, static_cast<int>(st.st_mode & 0777));
  });
  // Which peer segments connect() refuses, from what fstat() says of them.
  t.def("shm_segment_problem", &shm::segmentProblem, py::arg("owner"), py::arg("mode"),
        py::arg("size"), py::arg("expected"), py::arg("me"));
  t.def("is_segment_name", &shm::isSegmentName);
  // The matching of point-to-point messages to receives, without a transport.
  py::class_<TagMatcher>(t, "TagMatcher")
      .def(py::init<>())
      .def_readonly_static("ANY_SOURCE", &TagMatcher::kAnySource)
      .def("post",
           [](TagMatcher& m, uint64_t recv, int peer, int64_t tag) {
             const auto taken = m.post(recv, peer, tag);
             return taken ? std::optional(std::make_pair(taken->peer, taken->message))
                          : std::nullopt;
           },
           py::arg("recv"), py::arg("peer"), py::arg("tag"))
      .def("arrive", &TagMatcher::arrive, py::arg("peer"), py::arg("message"), py::arg("tag"))
      .def("wanted", &TagMatcher::wanted, py::arg("peer"), py::arg("tag"))
      .def("any_waiting", &TagMatcher::anyWaiting)
      .def("withdraw", &TagMatcher::withdraw, py::arg("recv"))
      .def("drop_peer", &TagMatcher::dropPeer, py::arg("peer"));
  // The wire formats (common/blob.h, common/descriptor.h) on their own.
  t.def("blob_write", [](const std::vector<std::pair<std::string, std::string>>& fields,
                         const std::vector<std::pair<std::string, py::bytes>>& bytesFields) {
    BlobWriter w;
    for (const auto& [k, v] : fields) w.put(k, v);
    for (const auto& [k, v] : bytesFields) w.putBytes(k, std::string(v));
    return w.str();
  });
  t.def("blob_read", [](const std::string& text, const std::string& key, const std::string& as) {
    const BlobReader r(text, "a test blob");
    if (as == "bytes") return py::object(py::bytes(r.bytes(key)));
    if (as == "int") return py::object(py::int_(r.get<int64_t>(key)));
    if (as == "uint") return py::object(py::int_(r.get<uint64_t>(key)));
    return py::object(py::str(r.str(key)));
  });
  auto desc = [](const py::dict& d) {
    CollectiveDesc c;
    c.seq = d.contains("seq") ? d["seq"].cast<uint64_t>() : 1;
    c.count = d.contains("count") ? d["count"].cast<uint64_t>() : 0;
    c.kind = static_cast<CollectiveKind>(d.contains("kind") ? d["kind"].cast<int>() : 0);
    c.dtype = static_cast<DataType>(d.contains("dtype") ? d["dtype"].cast<int>() : 0);
    c.op = d.contains("op") ? d["op"].cast<RedOp>() : RedOp::Sum;
    c.root = d.contains("root") ? d["root"].cast<int>() : -1;
    c.algo = d.contains("algo") ? d["algo"].cast<Algo>() : Algo::Ring;
    c.window = d.contains("window") ? d["window"].cast<uint64_t>() : 0;
    return c;
  };
  // algorithms::select() of a call (the descriptor's algo: what the front
  // end gave it), then vote() with a chooser that picks `pick` (kernel,
  // timed): the plan's fields by name, and (kind, bytes) where the chooser
  // was asked.
  t.def(
      "select",
      [](const std::string& kind, uint64_t count, const std::string& dtype, int root,
         const std::string& algo, const py::dict& caps, const GroupOptions& options,
         std::pair<bool, bool> pick, uint64_t window) {
        CollectiveDesc d;
        d.window = window;
        d.kind = kindNamed(kind);
        d.count = count;
        d.dtype = named(dtype, DataType::Int64, "dtype");
        d.root = root;
        d.algo = named(algo, Algo::Registered, "algo");
        const algorithms::Capabilities c{caps["rank"].cast<int>(),
                                         caps["world_size"].cast<int>(),
                                         caps["peer_memory"].cast<bool>(),
                                         caps["messages"].cast<bool>(),
                                         caps["reads_registered"].cast<bool>(),
                                         caps["reads_through_kernel"].cast<bool>(),
                                         caps["fused"].cast<bool>()};
        const FakeKernelChoice chooser({pick.first, pick.second});
        const algorithms::Plan p = algorithms::vote(algorithms::select(d, c, options), chooser);
        py::dict out;
        out["kind"] = toString(p.kind);
        out["bytes"] = p.bytes;
        out["algo"] = toString(p.algo);
        out["staged"] = toString(p.staged);
        out["messages"] = p.messages;
        out["mapped"] = p.reads.mapped;
        out["through_kernel"] = p.reads.throughKernel;
        out["votes"] = p.votes;
        out["kernel_vote"] = p.reads.kernelVote;
        out["timed"] = p.timed;
        out["asked"] = chooser.asked()
            ? py::object(py::make_tuple(toString(chooser.asked()->first), chooser.asked()->second))
            : py::object(py::none());
        return out;
      },
      py::arg("kind"), py::arg("count"), py::arg("dtype"), py::arg("root"), py::arg("algo"),
      py::arg("caps"), py::arg("options"), py::arg("pick") = std::make_pair(false, false),
      py::arg("window") = 0);
  t.def("reads_in_place",
        [](const std::string& kind) { return algorithms::readsInPlace(kindNamed(kind)); });
  t.def("describe_desc", [=](const py::dict& d) { return describe(desc(d)); });
  // The engine a "pyddp" group of torch.distributed sends all_reduce to for
  // tensors of `device`, made as a call on such tensors makes it (a CUDA
  // engine where no CUDA tensor can be made).
  t.def(
      "torch_backend_engine",
      [](TorchBackend& backend, c10::Device device) {
        return c10::intrusive_ptr<Engine>::unsafe_reclaim_from_nonowning(
            &backend.engineFor(device, "allreduce"));
      },
      py::arg("backend"), py::arg("device"), py::call_guard<py::gil_scoped_release>());
  // The mismatch message of rank `rank` holding descs[rank], both ways:
  // compared pairwise with every other rank (shm), and from the MAX
  // all-reduce of every rank's words (NCCL).
  t.def("desc_mismatch", [=](const std::vector<py::dict>& descs, int rank) {
    std::vector<CollectiveDesc> all;
    for (const auto& d : descs) all.push_back(desc(d));
    std::string pairwise;
    for (size_t k = 0; k < all.size() && pairwise.empty(); ++k) {
      pairwise = mismatch(all[rank], rank, all[k], static_cast<int>(k));
    }
    DescWords reduced{};
    for (const auto& d : all) {
      const DescWords w = encodeWords(d);
      for (int i = 0; i < kDescWords; ++i) reduced[i] = std::max(reduced[i], w[i]);
    }
    return std::make_pair(pairwise, mismatch(all[rank], reduced, rank));
  });

  // The fused collectives' wait decision, exactly as their channel programs
  // make it: None to keep waiting, else (error code, rank to blame), code 0
  // for satisfied.
  // backend/layout.h's kernelsTakeTurns over (uuid, mps) per rank.
  t.def("kernels_take_turns", [](const std::vector<std::pair<std::string, int>>& places) {
    std::vector<GpuPlace> p;
    for (const auto& [uuid, mps] : places) p.push_back(GpuPlace{uuid, mps});
    return kernelsTakeTurns(p);
  });
  t.def("fused_wait_verdict", [](uint64_t flag, uint64_t target, uint64_t peerFailed,
                                 int64_t abortWord, uint64_t elapsedNs, uint64_t timeoutNs,
                                 int32_t peer) -> std::optional<std::pair<int, int>> {
    const int64_t v =
        device::waitVerdict(flag, target, peerFailed, abortWord, elapsedNs, timeoutNs, peer);
    if (v < 0) return std::nullopt;
    return std::make_pair(static_cast<int>(device::errorCode(v)), v ? device::errorRank(v) : -1);
  });
  // A fused collective's plan per channel (device/programs.h), as the
  // programs and the host both compute it: by channel, (first element,
  // elements, elements per round, rounds, barriers); `registered`: a
  // registered launch's.
  t.def("fused_plan", [](int protocol, uint64_t count, int size, int channels,
                         size_t chunkBytes, size_t elementBytes, bool registered) {
    static const char buffer = 0;
    device::FusedArgs a{};
    if (registered) a.peer[0] = &buffer;
    a.protocol = static_cast<device::Protocol>(protocol);
    a.size = size;
    a.channels = channels;
    a.count = count;
    a.geometry = device::Geometry{channels, chunkBytes};
    std::vector<std::tuple<size_t, size_t, size_t, uint64_t, uint64_t>> plans;
    for (int c = 0; c < channels; ++c) {
      const device::ChannelPlan p = device::planChannel(a, c, elementBytes);
      plans.emplace_back(p.first, p.elements, p.roundElements, p.rounds, p.barriers);
    }
    return plans;
  }, py::arg("protocol"), py::arg("count"), py::arg("size"), py::arg("channels"),
     py::arg("chunk_bytes"), py::arg("element_bytes"), py::arg("registered") = false);
  t.def("reduce_n", [](RedOp op, int worldSize, std::vector<at::Tensor> srcs) {
    auto out = at::empty_like(srcs.at(0));
    std::vector<const void*> ptrs;
    for (auto& s : srcs) ptrs.push_back(s.data_ptr());
    kernels::reduceN({dtypeOf(srcs[0]), op, worldSize}, out.data_ptr(), ptrs.data(),
                     static_cast<int>(ptrs.size()), out.numel());
    return out;
  });

  // The grid kernels (kernels/elementwise.h) over caller-made tensors: views
  // at any offset (misaligned operands) or one tensor passed twice (in
  // place). emulated_* run them over an emulated (blocks, threads) grid on
  // CPU tensors and return (width, head, packs), the split they used;
  // cuda_* run the CUDA kernels on the current stream. The checks keep a
  // wrong test from writing out of bounds.
  auto accType = [](const at::Tensor& elems) {
    const auto s = elems.scalar_type();
    return s == at::kHalf || s == at::kBFloat16 ? at::kFloat : s;
  };
  auto expect = [](const at::Tensor& x, at::ScalarType dtype, int64_t numel, c10::Device device,
                   const char* what) {
    PYDDP_CHECK_VALUE(x.scalar_type() == dtype && x.numel() == numel && x.is_contiguous() &&
                          x.device() == device,
                      what, ": expected a contiguous ", dtype, " tensor of ", numel,
                      " elements on ", device, ", got ", x.scalar_type(), " of ", x.numel(),
                      " on ", x.device());
  };
  auto checkToPartial = [=](const at::Tensor& dst, const at::Tensor& src, c10::Device device) {
    expect(src, src.scalar_type(), src.numel(), device, "src");
    expect(dst, accType(src), src.numel(), device, "dst");
  };
  auto checkReducePartial = [=](const at::Tensor& dst, const at::Tensor& partial,
                                const at::Tensor& local, c10::Device device) {
    expect(local, local.scalar_type(), local.numel(), device, "local");
    expect(partial, accType(local), local.numel(), device, "partial");
    expect(dst, accType(local), local.numel(), device, "dst");
  };
  auto checkReduceFinal = [=](const at::Tensor& dst, const std::optional<at::Tensor>& dst2,
                              const at::Tensor& partial, const at::Tensor& local,
                              c10::Device device) {
    expect(local, local.scalar_type(), local.numel(), device, "local");
    expect(partial, accType(local), local.numel(), device, "partial");
    expect(dst, local.scalar_type(), local.numel(), device, "dst");
    if (dst2) expect(*dst2, local.scalar_type(), local.numel(), device, "dst2");
  };
  auto checkReduceN = [=](const at::Tensor& dst, const std::vector<at::Tensor>& srcs,
                          c10::Device device) {
    PYDDP_CHECK_VALUE(!srcs.empty(), "reduce_n needs at least one source");
    for (const auto& s : srcs) expect(s, dst.scalar_type(), dst.numel(), device, "src");
    expect(dst, dst.scalar_type(), dst.numel(), device, "dst");
  };
  auto checkCopy = [=](const at::Tensor& dst, const std::optional<at::Tensor>& dst2,
                       const at::Tensor& src, c10::Device device) {
    expect(src, src.scalar_type(), src.numel(), device, "src");
    expect(dst, src.scalar_type(), src.numel(), device, "dst");
    if (dst2) expect(*dst2, src.scalar_type(), src.numel(), device, "dst2");
  };
  auto ptrs = [](const std::vector<at::Tensor>& ts) {
    std::vector<const void*> out;
    for (const auto& x : ts) out.push_back(x.data_ptr());
    return out;
  };
  auto ptrOr = [](const std::optional<at::Tensor>& t) { return t ? t->data_ptr() : nullptr; };

  using Shape = std::pair<uint32_t, uint32_t>;
  auto shape = [](const Shape& g) { return kernels::emulated::Grid{g.first, g.second}; };
  auto split = [](const kernels::emulated::Launched& l) {
    return std::make_tuple(l.width, l.head, l.packs);
  };
  const c10::Device cpu(c10::kCPU);
  t.def("emulated_to_partial", [=](const Shape& g, at::Tensor dst, at::Tensor src) {
    checkToPartial(dst, src, cpu);
    return split(kernels::emulated::toPartial(shape(g), {dtypeOf(src), RedOp::Sum, 1},
                                              dst.data_ptr(), src.data_ptr(), src.numel()));
  });
  t.def("emulated_reduce_partial", [=](const Shape& g, RedOp op, int worldSize, at::Tensor dst,
                                       at::Tensor partial, at::Tensor local) {
    checkReducePartial(dst, partial, local, cpu);
    return split(kernels::emulated::reducePartial(shape(g), {dtypeOf(local), op, worldSize},
                                                  dst.data_ptr(), partial.data_ptr(),
                                                  local.data_ptr(), local.numel()));
  });
  t.def("emulated_reduce_final", [=](const Shape& g, RedOp op, int worldSize, at::Tensor dst,
                                     std::optional<at::Tensor> dst2, at::Tensor partial,
                                     at::Tensor local) {
    checkReduceFinal(dst, dst2, partial, local, cpu);
    return split(kernels::emulated::reduceFinal(shape(g), {dtypeOf(local), op, worldSize},
                                                dst.data_ptr(), ptrOr(dst2), partial.data_ptr(),
                                                local.data_ptr(), local.numel()));
  });
  t.def("emulated_reduce_n", [=](const Shape& g, RedOp op, int worldSize, at::Tensor dst,
                                 std::vector<at::Tensor> srcs) {
    checkReduceN(dst, srcs, cpu);
    const auto src = ptrs(srcs);
    return split(kernels::emulated::reduceN(shape(g), {dtypeOf(dst), op, worldSize},
                                            dst.data_ptr(), src.data(),
                                            static_cast<int>(src.size()), dst.numel()));
  });
  t.def("emulated_copy", [=](const Shape& g, at::Tensor dst, std::optional<at::Tensor> dst2,
                             at::Tensor src) {
    checkCopy(dst, dst2, src, cpu);
    return split(kernels::emulated::copy(shape(g), dst.data_ptr(), ptrOr(dst2), src.data_ptr(),
                                         src.nbytes()));
  });

#ifdef PYDDP_WITH_CUDA
  t.attr("has_cuda_kernels") = true;
  auto gpu = [](const at::Tensor& x) {
    PYDDP_CHECK_VALUE(x.is_cuda(), "expected a CUDA tensor, got one on ", x.device());
    return x.device();
  };
  auto stream = [](c10::Device device) {
    return c10::cuda::getCurrentCUDAStream(device.index()).stream();
  };
  t.def("cuda_to_partial", [=](at::Tensor dst, at::Tensor src) {
    checkToPartial(dst, src, gpu(src));
    const c10::cuda::CUDAGuard guard(src.device());
    kernels::cuda::toPartial({dtypeOf(src), RedOp::Sum, 1}, dst.data_ptr(), src.data_ptr(),
                             src.numel(), stream(src.device()));
  });
  t.def("cuda_reduce_partial", [=](RedOp op, int worldSize, at::Tensor dst, at::Tensor partial,
                                   at::Tensor local) {
    checkReducePartial(dst, partial, local, gpu(local));
    const c10::cuda::CUDAGuard guard(local.device());
    kernels::cuda::reducePartial({dtypeOf(local), op, worldSize}, dst.data_ptr(),
                                 partial.data_ptr(), local.data_ptr(), local.numel(),
                                 stream(local.device()));
  });
  t.def("cuda_reduce_final", [=](RedOp op, int worldSize, at::Tensor dst,
                                 std::optional<at::Tensor> dst2, at::Tensor partial,
                                 at::Tensor local) {
    checkReduceFinal(dst, dst2, partial, local, gpu(local));
    const c10::cuda::CUDAGuard guard(local.device());
    kernels::cuda::reduceFinal({dtypeOf(local), op, worldSize}, dst.data_ptr(), ptrOr(dst2),
                               partial.data_ptr(), local.data_ptr(), local.numel(),
                               stream(local.device()));
  });
  t.def("cuda_reduce_n", [=](RedOp op, int worldSize, at::Tensor dst,
                             std::vector<at::Tensor> srcs) {
    checkReduceN(dst, srcs, gpu(dst));
    const c10::cuda::CUDAGuard guard(dst.device());
    const auto src = ptrs(srcs);
    kernels::cuda::reduceN({dtypeOf(dst), op, worldSize}, dst.data_ptr(), src.data(),
                           static_cast<int>(src.size()), dst.numel(), stream(dst.device()));
  });
  t.def("cuda_copy", [=](at::Tensor dst, std::optional<at::Tensor> dst2, at::Tensor src) {
    checkCopy(dst, dst2, src, gpu(src));
    const c10::cuda::CUDAGuard guard(src.device());
    kernels::cuda::copy(dst.data_ptr(), ptrOr(dst2), src.data_ptr(), src.nbytes(),
                        stream(src.device()));
  });
  // Launches the copy kernel between two host buffers where no GPU is usable
  // (refused otherwise), so that a CPU machine sees a failed launch turn into
  // an exception.
  t.def("cuda_copy_without_gpu", [] {
    int devices = 0;
    PYDDP_CHECK_VALUE(cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0,
                      "cuda_copy_without_gpu only runs where no GPU is usable; found ", devices);
    std::vector<uint64_t> src(128, 1), dst(128, 0);
    kernels::cuda::copy(dst.data(), nullptr, src.data(), src.size() * sizeof(uint64_t), nullptr);
  });
#else
  t.attr("has_cuda_kernels") = false;
#endif

  // One collective on simulated ranks (threads) through the send/recv
  // ring's verbs; returns (outputs, per-rank error messages).
  t.def("sendrecv_ring", [](const std::string& kind, const std::vector<at::Tensor>& inputs,
                            const std::vector<RedOp>& ops, size_t pieceBytes, int root,
                            bool inPlace, int repeats, bool flush,
                            const std::vector<uint64_t>& seqs, int64_t timeoutMs) {
    const CollectiveKind k = kindNamed(kind);
    PYDDP_CHECK_VALUE(k <= CollectiveKind::Barrier, "sendrecv_ring runs no ", kind);
    const size_t n = inputs.size();
    PYDDP_CHECK_VALUE(n >= 1 && ops.size() == n && (seqs.empty() || seqs.size() == n),
                      "sendrecv_ring: one input and one op (and seq) per rank");
    PYDDP_CHECK_VALUE(!inPlace || k == CollectiveKind::AllReduce,
                      "sendrecv_ring: in_place is for all_reduce");
    std::vector<at::Tensor> ins, outs;
    std::vector<CollectiveDesc> descs(n);
    std::vector<kernels::ReduceSpec> specs;
    std::vector<const void*> inPtrs;
    std::vector<void*> outPtrs;
    for (size_t r = 0; r < n; ++r) {
      const at::Tensor in = inputs[r].contiguous();
      const DataType dtype = dtypeOf(in);
      const size_t count = k == CollectiveKind::ReduceScatter ? in.numel() / n : in.numel();
      at::Tensor out = k == CollectiveKind::AllGather
          ? at::empty({static_cast<int64_t>(count * n)}, in.options())
          : k == CollectiveKind::ReduceScatter
          ? at::empty({static_cast<int64_t>(count)}, in.options())
          : k == CollectiveKind::Broadcast || inPlace ? in.clone() : at::empty_like(in);
      descs[r].seq = seqs.empty() ? 1 : seqs[r];
      descs[r].count = count;
      descs[r].kind = k;
      descs[r].dtype = dtype;
      descs[r].op = ops[r];
      descs[r].root = k == CollectiveKind::Broadcast ? root : -1;
      descs[r].algo = Algo::Ring;
      specs.push_back({dtype, ops[r], static_cast<int>(n)});
      inPtrs.push_back(inPlace ? out.data_ptr() : in.data_ptr());
      outPtrs.push_back(out.data_ptr());
      ins.push_back(in);
      outs.push_back(out);
    }
    std::vector<std::string> errors;
    {
      py::gil_scoped_release noGil;
      errors = sendrecv::simulateRing(descs, specs, inPtrs, outPtrs, pieceBytes, repeats,
                                      flush, std::chrono::milliseconds(timeoutMs));
    }
    return std::make_pair(outs, errors);
  }, py::arg("kind"), py::arg("inputs"), py::arg("ops"), py::arg("piece_bytes"),
     py::arg("root") = 0, py::arg("in_place") = false, py::arg("repeats") = 1,
     py::arg("flush") = true, py::arg("seqs") = std::vector<uint64_t>{},
     py::arg("timeout_ms") = 10000);
}

} // namespace testing
} // namespace pyddp
