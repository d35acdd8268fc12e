// The only pybind11 file of pyddp._C's public face: options, the engines
// (bound once, through their base class), the registry that makes them and
// torch.distributed's backend that holds them. It sees backend/ and common/
// only. Every call that can wait releases the GIL, and lets Python's signal
// handlers interrupt its waits. The test-only helpers live in csrc/testing/.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/bootstrap.h"
#include "backend/cpu_executor.h"
#include "backend/engine_registry.h"
#include "backend/fused_engine.h"
#include "backend/registered_tensors.h"
#include "backend/transport_engine.h"
#include "backend/torch_backend.h"
#include "common/check.h"
#include "common/config.h"
#include "common/host.h"
#include "common/interrupt.h"
#include "common/process_state.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/nccl_engine.h"
#endif

#ifdef PYDDP_WITH_TESTING
#include "testing/bind.h"
#endif

namespace py = pybind11;
using namespace pyddp;

namespace {

// The GIL of one call, given up at most once and taken back when the call
// returns; unless the interpreter is exiting (common/process_state.h): the
// thread then parks before it would take the GIL back, which ends it from
// this destructor and so aborts the process.
class GilHandoff {
 public:
  GilHandoff() = default;
  ~GilHandoff() {
    if (saved_ == nullptr) return;
    process::parkIfExiting();
    PyEval_RestoreThread(saved_);
  }
  GilHandoff(const GilHandoff&) = delete;
  GilHandoff& operator=(const GilHandoff&) = delete;

  void release() {
    if (saved_ == nullptr) saved_ = PyEval_SaveThread();
  }

 private:
  PyThreadState* saved_ = nullptr;
};

// pybind's call guard for calls that give the GIL up for their whole
// length, parking at exit as GilHandoff does.
class ReleaseGil {
 public:
  ReleaseGil() : saved_(PyEval_SaveThread()) {}
  ~ReleaseGil() {
    process::parkIfExiting();
    PyEval_RestoreThread(saved_);
  }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* const saved_;
};

// When a call lets Python's other threads run: at once, or only once it
// starts to wait (common/interrupt.h), which a small synchronous call on
// ranks that are all inside it never does: it spins for a microsecond or
// so, and giving up the GIL and taking it back were 3% of a 2-rank 4 KiB
// all_reduce (benchmarks/studies/the-gil-of-a-small-call.md). What a call
// does before it waits must then be short: HoldsGil::WhileSpinning is for calls on
// small tensors only (kHoldGilMaxBytes), whose copies take microseconds,
// and a wait spins for at most Backoff::kSpinPhase before it asks.
enum class HoldsGil { Never, WhileSpinning };

// Python's signal handlers, run by pyddp's waits (common/interrupt.h) every
// few milliseconds with the GIL taken briefly. When a handler raises
// (KeyboardInterrupt for Ctrl-C), the wait gives up, and the call raises the
// handler's exception instead of the error the wait ended with.
class PythonSignals {
 public:
  // `f` with Python's handlers installed as its interrupt check, and the GIL
  // released as `holds` says.
  template <typename F>
  auto run(F&& f, HoldsGil holds) {
    try {
      auto result = [&] {
        GilHandoff gil;
        if (holds == HoldsGil::Never) gil.release();
        InterruptScope scope([this] { return check(); }, [&gil] { gil.release(); });
        return f();
      }();
      raiseIfRaised();
      return result;
    } catch (const py::error_already_set&) {
      throw;
    } catch (...) {
      // A rank interrupted at once with its peers (Ctrl-C of a whole job)
      // may see a peer give up before its own check runs: the signal is
      // still the reason to report.
      if (!raised_) check();
      raiseIfRaised();
      throw;
    }
  }

 private:
  bool check() {
    process::parkIfExiting();
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() == 0) return false;
    raised_ = std::make_unique<py::error_already_set>();  // takes the pending exception
    return true;
  }
  void raiseIfRaised() {
    if (!raised_) return;
    py::error_already_set error = std::move(*raised_);
    raised_.reset();
    throw error;
  }

  std::unique_ptr<py::error_already_set> raised_;
};

// `f` interruptible by Python's signal handlers, with the GIL released at
// once or, with HoldsGil::WhileSpinning, once it starts to wait.
template <typename F>
auto interruptibly(F&& f, HoldsGil holds = HoldsGil::Never) {
  return PythonSignals().run(std::forward<F>(f), holds);
}

// A synchronous call, from a pybind entry or a direct one (below): it waits
// here for its Work, if the executor made one, with the GIL released (the
// Work completes on the worker, whose future callbacks may take the GIL).
template <typename Start>
void runToEnd(std::chrono::milliseconds timeout, Start&& start,
              HoldsGil holds = HoldsGil::Never) {
  const CallOptions call{/*asyncOp=*/false, timeout, /*workless=*/true};
  interruptibly(
      [&] {
        if (const WorkPtr work = start(call)) {
          aboutToBlock();
          work->wait();
        }
        return true;
      },
      holds);
}

// An entry point as Python calls it. With async_op, the Work at once. A
// synchronous call waits here and returns None: no Work crosses into
// Python, and the CPU executor makes none when it runs the collective at
// once (on a 4 KiB all_reduce the Work, its future and the second call into
// the module to wait for it cost as much as the shared-memory transfer).
template <typename Start>
py::object issue(bool asyncOp, const std::optional<std::chrono::milliseconds>& timeout,
                 Start&& start) {
  const auto bound = timeout.value_or(c10d::kUnsetTimeout);
  if (asyncOp) {
    return py::cast(interruptibly([&] { return start(CallOptions{true, bound, false}); }));
  }
  runToEnd(bound, start);
  return py::none();
}

// The synchronous entries of the calls that carry small messages, for
// pyddp's ProcessGroup, which sets each on the group object under the name
// of its method: builtins bound to one engine (METH_FASTCALL, a capsule
// holding the engine as their self) that take the method's arguments as
// they are and sort them out here, where it costs less than in Python.
// Through pybind's dispatcher (a bound method made per call, keyword
// matching, a type lookup per argument) a barrier of one rank took 544 ns
// through ProcessGroup, and 325 ns through these; the method's own Python
// frame in front of them was another 45 ns of a 2-rank barrier's 450 and
// 115 of a 4 KiB all_reduce's 1650 (loops of each, interleaved). An entry
// runs a call whose arguments are the method's (by position or keyword)
// with async_op False or left out, a tensor of the engine's device, an op
// that is one of the members it was given (SUM when left out) and a src
// that is an int rank of the group; it passes every other call on, as
// given, to the method's general path (`general`), which checks and
// reports. Errors reach Python as torch's translation makes them for every
// pybind entry.
namespace direct {

constexpr const char* kCapsule = "pyddp.DirectEntries";

// The entries, in kEntries' order.
enum EntryIndex : size_t {
  kAllReduceEntry,
  kAllGatherSingleEntry,
  kReduceScatterSingleEntry,
  kBroadcastEntry,
  kBarrierEntry,
  kNumEntries
};

// What the entries' capsule holds. Destroyed by the capsule, with the GIL.
struct Bound {
  c10::intrusive_ptr<Engine> engine;
  // ReduceOp's members, compared by identity (hashing a member calls a
  // Python-level pybind11 function), each with its RedOp.
  std::vector<std::pair<py::object, RedOp>> ops;
  // By entry: what takes the calls the entry passes on.
  std::array<py::object, kNumEntries> general;
};

// The capsule holds its Bound as its pointer (for its destructor) and as
// its context, read per call: PyCapsule_GetPointer compares the capsule's
// name with strcmp each time.
const Bound& boundOf(PyObject* self) {
  return *static_cast<const Bound*>(PyCapsule_GetContext(self));
}

// What an argument of an entry converts to, given or left out (nullptr),
// if it is one the entry takes (std::nullopt if not).
//
// A tensor is borrowed from the call's arguments, which Python keeps alive
// until the entry returns: a copy of the handle of a tensor that Python
// holds gains a reference to its PyObject (c10::intrusive_ptr), which
// takes the GIL, and loses it when the last copy goes, which takes it
// again. A call that gives up the GIL at once (HoldsGil::Never) first takes
// a reference of its own (held()), dropped with the GIL held again:
// without it the engine's copies, dropped with the GIL released, took and
// gave back the GIL once per call (one rank, 4 KiB all_reduce through
// ProcessGroup: 1160 -> 1025 ns, interleaved runs of each). A call that
// keeps the GIL copies no handle of a contiguous tensor on the CPU ring
// engine's path (TransportEngine::submit); one that does (a strided tensor, a
// call queued behind async work) makes its copies with the GIL held, and
// its last copy, if dropped once the GIL was given up (a wait past its
// spin phase, or on the worker), takes the GIL once more.
struct TensorArg {
  static std::optional<std::reference_wrapper<const at::Tensor>> from(const Bound& b,
                                                                       PyObject* arg) {
    if (arg == nullptr || !THPVariable_Check(arg)) return std::nullopt;
    const at::Tensor& t = THPVariable_Unpack(arg);
    if (t.device() != b.engine->device()) return std::nullopt;
    return std::cref(t);
  }
};
struct OpArg {
  static std::optional<RedOp> from(const Bound& b, PyObject* arg) {
    if (arg == nullptr) return RedOp::Sum;  // the methods' default
    for (const auto& [member, op] : b.ops) {
      if (member.ptr() == arg) return op;
    }
    return std::nullopt;
  }
};
// The bytes a converted argument holds, to choose HoldsGil by (a sparse
// tensor's as if dense: at::Tensor::nbytes refuses sparse ones).
size_t bytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}
size_t bytesOf(RedOp) {
  return 0;
}
size_t bytesOf(int64_t) {
  return 0;
}
// A converted argument as the call keeps it while the GIL is released.
at::Tensor held(const at::Tensor& t) {
  return t;
}
RedOp held(RedOp op) {
  return op;
}
int64_t held(int64_t rank) {
  return rank;
}

// An int (not a bool) that fits 64 bits; the engine checks that it names
// a rank.
struct RankArg {
  static std::optional<int64_t> from(const Bound&, PyObject* arg) {
    if (arg == nullptr || !PyLong_CheckExact(arg)) return std::nullopt;  // not a bool either
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow != 0) return std::nullopt;
    return static_cast<int64_t>(value);
  }
};

// Sets given[i] to the argument of parameter params[i] (nullptr: left out)
// from a vectorcall's positional arguments and keywords; false if they do
// not fit the parameters (too many, or a keyword that is not one of them or
// names a parameter given by position).
template <size_t N>
bool sortArgs(const char* const* params, PyObject* const* args, Py_ssize_t nargs,
              PyObject* kwnames, std::array<PyObject*, N>& given) {
  if (nargs > static_cast<Py_ssize_t>(N)) return false;
  std::copy(args, args + nargs, given.begin());
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t j = 0; j < nkw; ++j) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, j);
    size_t i = 0;
    while (i < N && PyUnicode_CompareWithASCIIString(key, params[i]) != 0) ++i;
    if (i == N || given[i] != nullptr) return false;
    given[i] = args[nargs + j];
  }
  return true;
}

// The largest tensors (in bytes, all of a call's together) whose call
// keeps the GIL while it spins (HoldsGil): up to it the GIL's handoff is a
// small part of the call, above it the call would hold the GIL for longer
// (benchmarks/studies/the-gil-of-a-small-call.md, "Up to 16 KiB").
constexpr size_t kHoldGilMaxBytes = 16 * 1024;

// Entry `I`: the engine's `Method` on arguments of the kinds `Args`, named
// `Params` (async_op last, after them), converted in order while the GIL is
// held, then run as a synchronous call.
//
// Errors are translated as torch's HANDLE_TH_ERRORS does, without its
// warning handler, whose two thread-local swaps were about 20 ns of every
// call (perf): a torch warning raised inside a call goes to c10's own
// handler, as from pyddp's pybind entries, instead of becoming a Python
// warning.
template <size_t I, const auto& Params, auto Method, typename... Args>
PyObject* entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) try {
  constexpr size_t kAsync = sizeof...(Args);
  static_assert(std::size(Params) == kAsync + 1, "a name per argument, and async_op");
  const Bound& bound = boundOf(self);
  std::array<PyObject*, kAsync + 1> given{};
  if (sortArgs(Params, args, nargs, kwnames, given) &&
      (given[kAsync] == nullptr || given[kAsync] == Py_False)) {
    const bool ran = [&]<size_t... K>(std::index_sequence<K...>) {
      const std::tuple<decltype(Args::from(bound, nullptr))...> values{
          Args::from(bound, given[K])...};
      if (!(std::get<K>(values).has_value() && ...)) return false;
      Engine& engine = *bound.engine;
      const size_t bytes = (size_t{0} + ... + bytesOf(*std::get<K>(values)));
      if (bytes <= kHoldGilMaxBytes && engine.spinsWithGil()) {
        runToEnd(
            c10d::kUnsetTimeout,
            [&](const CallOptions& c) { return (engine.*Method)(*std::get<K>(values)..., c); },
            HoldsGil::WhileSpinning);
      } else {
        const std::tuple kept{held(*std::get<K>(values))...};
        runToEnd(c10d::kUnsetTimeout, [&](const CallOptions& c) {
          return (engine.*Method)(std::get<K>(kept)..., c);
        });
      }
      return true;
    }(std::index_sequence_for<Args...>{});
    if (ran) Py_RETURN_NONE;
  }
  PyObject* result = PyObject_Vectorcall(bound.general[I].ptr(), args, nargs, kwnames);
  if (result == nullptr) throw python_error();  // restored as it was below
  return result;
} catch (const std::exception&) {
  torch::translate_exception_to_python(std::current_exception());
  return nullptr;
}

template <auto F>
PyCFunction fastcall() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(F));
}

constexpr char kTensor[] = "tensor";
constexpr char kOp[] = "op";
constexpr char kOutput[] = "output";
constexpr char kInput[] = "input";
constexpr char kSrc[] = "src";
constexpr char kAsyncOp[] = "async_op";
constexpr const char* kAllReduceParams[] = {kTensor, kOp, kAsyncOp};
constexpr const char* kAllGatherSingleParams[] = {kOutput, kInput, kAsyncOp};
constexpr const char* kReduceScatterSingleParams[] = {kOutput, kInput, kOp, kAsyncOp};
constexpr const char* kBroadcastParams[] = {kTensor, kSrc, kAsyncOp};
constexpr const char* kBarrierParams[] = {kAsyncOp};

constexpr int kFlags = METH_FASTCALL | METH_KEYWORDS;
PyMethodDef kEntries[kNumEntries] = {
    {"all_reduce",
     fastcall<entry<kAllReduceEntry, kAllReduceParams, &Engine::allReduce, TensorArg, OpArg>>(),
     kFlags, "ProcessGroup.all_reduce(tensor, op=ReduceOp.SUM, async_op=False)"},
    {"all_gather_single",
     fastcall<entry<kAllGatherSingleEntry, kAllGatherSingleParams, &Engine::allGatherSingle,
                    TensorArg, TensorArg>>(),
     kFlags, "ProcessGroup.all_gather_single(output, input, async_op=False)"},
    {"reduce_scatter_single",
     fastcall<entry<kReduceScatterSingleEntry, kReduceScatterSingleParams,
                    &Engine::reduceScatterSingle, TensorArg, TensorArg, OpArg>>(),
     kFlags, "ProcessGroup.reduce_scatter_single(output, input, op=ReduceOp.SUM, async_op=False)"},
    {"broadcast",
     fastcall<entry<kBroadcastEntry, kBroadcastParams, &Engine::broadcastFrom, TensorArg,
                    RankArg>>(),
     kFlags, "ProcessGroup.broadcast(tensor, src, async_op=False)"},
    {"barrier", fastcall<entry<kBarrierEntry, kBarrierParams, &Engine::barrierAll>>(), kFlags,
     "ProcessGroup.barrier(async_op=False)"},
};

// The entries bound to `engine` and `ops`, by name, each passing what it
// does not take to general[name]; each keeps all of them alive.
py::dict entriesOf(const c10::intrusive_ptr<Engine>& engine,
                   std::vector<std::pair<py::object, RedOp>> ops, const py::dict& general) {
  auto held = std::make_unique<Bound>(Bound{engine, std::move(ops), {}});
  for (size_t i = 0; i < kNumEntries; ++i) {
    const char* name = kEntries[i].ml_name;
    PYDDP_CHECK_VALUE(general.contains(name), "direct_entries: general has no entry ", name);
    held->general[i] = general[name];
  }
  const auto capsule = py::reinterpret_steal<py::object>(
      PyCapsule_New(held.get(), kCapsule, [](PyObject* capsule) {
        delete static_cast<Bound*>(PyCapsule_GetPointer(capsule, kCapsule));
      }));
  if (!capsule) throw py::error_already_set();
  Bound* bound = held.release();  // the capsule's now
  if (PyCapsule_SetContext(capsule.ptr(), bound) != 0) throw py::error_already_set();
  py::dict entries;
  for (PyMethodDef& def : kEntries) {
    const auto f = py::reinterpret_steal<py::object>(PyCFunction_New(&def, capsule.ptr()));
    if (!f) throw py::error_already_set();
    entries[def.ml_name] = f;
  }
  return entries;
}

} // namespace direct

// Groups between hosts are torch's gloo, made through torch's Python
// binding: gloo's C++ headers do not ship with torch.
c10::intrusive_ptr<c10d::Backend> torchGloo(const c10::intrusive_ptr<c10d::Store>& store,
                                            int rank, int size,
                                            std::chrono::milliseconds timeout) {
  py::gil_scoped_acquire gil;
  const py::object gloo = py::module_::import("torch.distributed").attr("ProcessGroupGloo");
  return gloo(store, rank, size, timeout).cast<c10::intrusive_ptr<c10d::Backend>>();
}

// Logs an engine that a "pyddp" group of torch.distributed made through
// pyddp's logger (pyddp/torch_backend.py): the CPU engine with the group,
// a CUDA engine inside the call that needed it, where the GIL is free.
void logTorchEngine(int rank, int size, const EngineChoice& choice) {
  process::parkIfExiting();
  py::gil_scoped_acquire gil;
  const Engine& engine = *choice.engine;
  py::module_::import("pyddp.torch_backend")
      .attr("_log_engine")(rank, size, engine.device(), engine.transport(), choice.refusals,
                           choice.layout);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyddp's C++ core. Use the pyddp package, not this module.";
  const auto release = py::call_guard<ReleaseGil>();

  // What the import-time check compares with the running torch.
  m.attr("torch_version") = TORCH_VERSION;
#ifdef PYDDP_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("nccl_version", [] {
    const auto v = nccl::version();
    return py::make_tuple(v[0], v[1], v[2]);
  }, "The NCCL library's version: (major, minor, patch).");
#else
  m.attr("has_cuda") = false;
#endif

  py::enum_<RedOp>(m, "RedOp")
      .value("SUM", RedOp::Sum)
      .value("AVG", RedOp::Avg)
      .value("PRODUCT", RedOp::Product)
      .value("MIN", RedOp::Min)
      .value("MAX", RedOp::Max)
      .value("BAND", RedOp::BitAnd)
      .value("BOR", RedOp::BitOr)
      .value("BXOR", RedOp::BitXor);

  py::enum_<Algo>(m, "Algo",
                  "How an all-reduce runs: by size (AUTO), or forced; RING and DIRECT "
                  "force all-gather and reduce-scatter too.")
      .value("AUTO", Algo::Auto)
      .value("RING", Algo::Ring)
      .value("DIRECT", Algo::Direct)
      .value("TWO_SHOT", Algo::TwoShot);

  py::enum_<SlotStores>(m, "SlotStores",
                        "How a rank writes the pieces it copies into its ring slots: chosen "
                        "by measurement (AUTO), or forced to CACHED or STREAMING "
                        "(non-temporal) stores.")
      .value("AUTO", SlotStores::Auto)
      .value("CACHED", SlotStores::Cached)
      .value("STREAMING", SlotStores::Streaming);

  py::enum_<CmaReads>(m, "CmaReads",
                      "Whether all_gather, broadcast, all_reduce and reduce_scatter read "
                      "peers' plain CPU tensors through the kernel (cross-memory attach) "
                      "from cma_min_bytes per rank "
                      "on: on the calls a measurement picks (AUTO), on every call "
                      "(ALWAYS), or NEVER.")
      .value("AUTO", CmaReads::Auto)
      .value("ALWAYS", CmaReads::Always)
      .value("NEVER", CmaReads::Never);

  py::class_<GroupOptions>(m, "GroupOptions")
      .def(py::init(&GroupOptions::fromEnv), "GroupOptions with defaults from PYDDP_* variables.")
      .def(py::init<const GroupOptions&>(), "A copy.")
      .def_readwrite("slot_bytes", &GroupOptions::slotBytes)
      .def_readwrite("num_slots", &GroupOptions::numSlots)
      .def_readwrite("direct_max_bytes", &GroupOptions::directMaxBytes)
      .def_readwrite("two_shot_max_bytes", &GroupOptions::twoShotMaxBytes)
      .def_readwrite("algo", &GroupOptions::algo)
      .def_readwrite("timeout_ms", &GroupOptions::timeoutMs)
      .def_readwrite("p2p_buffer_bytes", &GroupOptions::p2pBufferBytes)
      .def_readwrite("slot_stores", &GroupOptions::slotStores)
      .def_readwrite("cma", &GroupOptions::cma)
      .def_readwrite("cma_min_bytes", &GroupOptions::cmaMinBytes)
      .def("validate", &GroupOptions::validate);

  m.def("settings", &settings, "Every PYDDP_* environment variable and its value.");

  m.def("empty_registered", &emptyRegistered, py::arg("size"), py::arg("dtype"),
        "A contiguous CPU tensor in registered memory, zero-filled.");
  m.def("is_registered", &isRegistered, py::arg("tensor"),
        "Whether `tensor` is contiguous and wholly in registered memory.");

  // Every entry point takes async_op and an optional per-call timeout.
  using Timeout = std::optional<std::chrono::milliseconds>;
  const auto async = py::arg("async_op");
  const auto timeout = py::arg("timeout") = Timeout();
  using T = const at::Tensor&;
  using Ts = const std::vector<at::Tensor>&;
  using Splits = const std::vector<int64_t>&;
  using C = const CallOptions&;
  py::class_<Engine, c10d::Backend, c10::intrusive_ptr<Engine>>(
      m, "Engine", "Runs a group's collectives for the tensors of one device.")
      .def("all_reduce", [](Engine& e, T t, RedOp op, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allReduce(t, op, c); });
      }, py::arg("tensor"), py::arg("op"), async, timeout)
      .def("all_gather_single", [](Engine& e, T out, T in, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allGatherSingle(out, in, c); });
      }, py::arg("output"), py::arg("input"), async, timeout)
      .def("all_gather", [](Engine& e, Ts outs, T in, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allGatherList(outs, in, c); });
      }, py::arg("tensor_list"), py::arg("tensor"), async, timeout)
      .def("broadcast", [](Engine& e, T t, int64_t src, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.broadcastFrom(t, src, c); });
      }, py::arg("tensor"), py::arg("src"), async, timeout)
      .def("reduce_scatter_single", [](Engine& e, T out, T in, RedOp op, bool a,
                                        const Timeout& to) {
        return issue(a, to, [&](C c) { return e.reduceScatterSingle(out, in, op, c); });
      }, py::arg("output"), py::arg("input"), py::arg("op"), async, timeout)
      .def("barrier", [](Engine& e, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.barrierAll(c); });
      }, async, timeout)
      .def("reduce", [](Engine& e, T t, RedOp op, int64_t dst, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.reduceTo(t, op, dst, c); });
      }, py::arg("tensor"), py::arg("op"), py::arg("dst"), async, timeout)
      .def("gather", [](Engine& e, Ts outs, T in, int64_t dst, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.gatherTo(outs, in, dst, c); });
      }, py::arg("gather_list"), py::arg("tensor"), py::arg("dst"), async, timeout)
      .def("scatter", [](Engine& e, T out, Ts ins, int64_t src, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.scatterFrom(out, ins, src, c); });
      }, py::arg("tensor"), py::arg("scatter_list"), py::arg("src"), async, timeout)
      .def("all_to_all_single", [](Engine& e, T out, T in, Splits outSplits, Splits inSplits,
                                    bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allToAllSingle(out, in, outSplits, inSplits, c); });
      }, py::arg("output"), py::arg("input"), py::arg("output_split_sizes"),
         py::arg("input_split_sizes"), async, timeout)
      .def("all_to_all", [](Engine& e, Ts outs, Ts ins, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allToAllList(outs, ins, c); });
      }, py::arg("output_tensor_list"), py::arg("input_tensor_list"), async, timeout)
      .def("all_reduce_coalesced", [](Engine& e, Ts ts, RedOp op, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allReduceCoalesced(ts, op, c); });
      }, py::arg("tensors"), py::arg("op"), async, timeout)
      .def("all_gather_coalesced", [](Engine& e, Ts outs, Ts ins, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allGatherCoalesced(outs, ins, c); });
      }, py::arg("outputs"), py::arg("inputs"), async, timeout)
      .def("all_gather_coalesced_lists", [](Engine& e, const std::vector<std::vector<at::Tensor>>&
                                                outLists, Ts ins, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.allGatherCoalescedLists(outLists, ins, c); });
      }, py::arg("output_lists"), py::arg("inputs"), async, timeout)
      .def("reduce_scatter_coalesced", [](Engine& e, Ts outs, Ts ins, RedOp op, bool a,
                                           const Timeout& to) {
        return issue(a, to, [&](C c) { return e.reduceScatterCoalesced(outs, ins, op, c); });
      }, py::arg("outputs"), py::arg("inputs"), py::arg("op"), async, timeout)
      .def("send", [](Engine& e, T t, int64_t dst, int64_t tag, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.sendTo(t, dst, tag, c); });
      }, py::arg("tensor"), py::arg("dst"), py::arg("tag"), async, timeout)
      .def("recv", [](Engine& e, T t, int64_t src, int64_t tag, bool a, const Timeout& to) {
        return issue(a, to, [&](C c) { return e.recvFrom(t, src, tag, c); });
      }, py::arg("tensor"), py::arg("src"), py::arg("tag"), async, timeout)
      .def("monitored_barrier", [](Engine& e, const Timeout& to, bool waitAll) {
        c10d::BarrierOptions opts;
        opts.timeout = to.value_or(c10d::kUnsetTimeout);
        interruptibly([&] {
          e.monitoredBarrier(opts, waitAll);
          return true;
        });
      }, py::arg("timeout"), py::arg("wait_all_ranks"),
         "c10d's monitoredBarrier: rank 0 names the ranks that did not arrive in `timeout` "
         "(None: the group's).")
      .def("direct_entries", &direct::entriesOf, py::arg("ops"), py::arg("general"),
           "The synchronous entries for this engine's tensors, by name, with ProcessGroup's "
           "signatures: all_reduce, all_gather_single, reduce_scatter_single, broadcast, "
           "barrier; `ops` pairs the objects taken as op with their RedOp. Each runs a "
           "synchronous call on arguments it takes and returns None, and passes any other "
           "call on, as given, to `general`'s callable of its name.")
      .def("shutdown", &Engine::shutdown, release)
      .def("abort", &Engine::abort, release,
           "Fails every pending and later call on this engine, and peers waiting on this "
           "rank at once, saying the group was aborted.")
      .def_property_readonly("aborted", &Engine::aborted)
      .def_property_readonly("device", &Engine::device)
      .def_property_readonly("transport", &Engine::transport);

  py::class_<FusedEngine, Engine, c10::intrusive_ptr<FusedEngine>>(
      m, "FusedEngine", "pyddp's fused collectives: one launch per collective.")
      .def("register_buffer", [](FusedEngine& e, const at::Tensor& t) {
        interruptibly([&] {
          e.registerBuffer(t);
          return true;
        });
      }, py::arg("tensor"),
           "Registers `tensor` with every rank (a collective): collectives on tensors that lie "
           "in it at the same offset on every rank read the peers' where they lie.")
      .def("deregister_buffer", [](FusedEngine& e, const at::Tensor& t) {
        interruptibly([&] {
          e.deregisterBuffer(t);
          return true;
        });
      }, py::arg("tensor"),
           "Ends the registration of `tensor` on every rank (a collective, with a barrier).")
      .def_property_readonly("registers_buffers", &FusedEngine::registersBuffers,
                             "Whether register_buffer serves this engine (not cuda_host).")
      .def_property_readonly("registered_launches", &FusedEngine::registeredLaunches,
                             "Collectives that read registered buffers in place so far.");

  py::class_<TransportEngine, Engine, c10::intrusive_ptr<TransportEngine>>(
      m, "TransportEngine", "pyddp's ring and direct algorithms over a transport.")
      .def_property_readonly("options", &TransportEngine::options)
      .def_property_readonly("registered_refusal", &TransportEngine::registeredRefusal,
                             "Why this engine never reads registered tensors (pyddp.empty) "
                             "in place; \"\" if it does at the sizes that measured faster.")
      .def_property_readonly("process_refusal", &TransportEngine::processRefusal,
                             "Why this engine never reads peers' plain tensors through the "
                             "kernel (cross-memory attach); \"\" if it may, as "
                             "options.cma says, from options.cma_min_bytes per rank on.");
#ifdef PYDDP_WITH_CUDA
  py::class_<NcclEngine, Engine, c10::intrusive_ptr<NcclEngine>>(
      m, "NcclEngine", "NCCL's own collectives.")
      .def_property_readonly("timeout_ms", [](const NcclEngine& e) { return e.timeout().count(); });
#endif

  m.def(
      "wait",
      [](const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
        return interruptibly([&] { return work->wait(timeout); });
      },
      py::arg("work"), py::arg("timeout"),
      "work.wait(timeout) (0: no limit), interruptible by Python's signal handlers.");
  m.def("begin_exit", &process::beginExit,
        "The interpreter is exiting (pyddp's exit hook calls it first): from now on a thread "
        "leaving a pyddp call for Python parks instead, since taking the GIL back during "
        "finalisation would abort the process.");
  m.def("shut_down_live_engines", &shutDownLiveEngines, release,
        "Shuts down every engine made for a group that is still alive, torch.distributed's "
        "groups of the \"pyddp\" backend among them (pyddp calls it at exit).");
  m.def("join_stopped_workers", &joinStoppedWorkers, release,
        "Joins CPU workers stopped from their own future callbacks (pyddp calls it at exit).");

  // Where a rank runs, and whether it still does, for agreement on who is
  // alive (pyddp/survival.py): a pid can be looked up only by a process on
  // the same host and in the same pid namespace.
  m.def("host_id", &hostId, "This machine's identity (the hostname and the boot id).");
  m.def("pid_namespace", &pidNamespace, "This process's pid namespace.");
  m.def("process_alive", &processAlive, py::arg("pid"),
        "False once `pid` has exited (a zombie counts as exited).");

  m.def("backend_names", &backendNames, "The backend names this build serves.");
  m.def("device_types_of", &deviceTypesOf, py::arg("backend"),
        "The device types (\"cpu\", \"cuda\") a group of `backend` serves.");
  m.def(
      "make_engine",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const GroupOptions& options, c10::Device device, const std::string& backend) {
        EngineChoice choice = interruptibly(
            [&] { return makeEngine(store, rank, size, options, device, backend, torchGloo); });
        return std::make_tuple(choice.engine, choice.refusals, choice.layout);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), py::arg("device"),
      py::arg("backend"),
      "(engine, refusals, layout): the engine of `backend` for `device`, why each candidate "
      "before it was passed over, and where the ranks run (CPU engines).");
  py::class_<TorchBackend, c10d::Backend, c10::intrusive_ptr<TorchBackend>>(
      m, "TorchBackend",
      "What torch.distributed's \"pyddp\" backend gives torch for a group: an engine per "
      "device type, the CUDA one made at the group's first call on CUDA tensors.")
      .def_property_readonly("engines", &TorchBackend::engines,
                             "The engines made so far, the CPU's first.");
  m.def(
      "make_torch_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const GroupOptions& options, const std::string& backend) {
        return interruptibly([&] {
          return c10::make_intrusive<TorchBackend>(
              store, rank, size, options, backend, torchGloo,
              [rank, size](const EngineChoice& choice) { logTorchEngine(rank, size, choice); });
        });
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), py::arg("backend"),
      "The c10d backend of a torch.distributed group of \"pyddp\" on `store` (the group's "
      "own): its CPU engine of `backend`, made now, and its CUDA engine of \"auto\", made at "
      "the group's first call on CUDA tensors. Each engine is logged as it is made.");
  m.def(
      "agree_on_group",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::vector<int>& ranks,
         const std::string& request, const std::string& call,
         std::chrono::milliseconds timeout) {
        interruptibly([&] {
          bootstrap::agree(*store, rank, ranks, request, call, timeout);
          return true;  // run() returns what its function does
        });
      },
      py::arg("store"), py::arg("rank"), py::arg("ranks"), py::arg("request"), py::arg("call"),
      py::arg("timeout"),
      "Every rank of `ranks` publishes `request` and reads the others'; DistBackendError "
      "naming each distinct request and its ranks unless all are equal, or naming a rank that "
      "does not come within `timeout` or exits.");

#ifdef PYDDP_WITH_TESTING
  testing::bindTesting(m);
#endif
}
