// The only pybind11 file of pyddp._C's public face: options, the engines
// (bound once, through their base class) and the registry that makes them.
// It sees backend/ and common/ only. Every call that can wait releases the
// GIL, and lets Python's signal handlers interrupt its waits. The test-only
// helpers live in csrc/testing/.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/version.h>

#include "backend/cpu_executor.h"
#include "backend/engine_registry.h"
#include "backend/ring_engine.h"
#include "common/check.h"
#include "common/config.h"
#include "common/interrupt.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/nccl_engine.h"
#endif

#ifdef PYDDP_WITH_TESTING
#include "testing/bind.h"
#endif

namespace py = pybind11;
using namespace pyddp;

namespace {

// Python's signal handlers, run by pyddp's waits (common/interrupt.h) every
// few milliseconds with the GIL taken briefly. When a handler raises
// (KeyboardInterrupt for Ctrl-C), the wait gives up, and the call raises the
// handler's exception instead of the error the wait ended with.
class PythonSignals {
 public:
  // `f` with the GIL released and Python's handlers installed as its
  // interrupt check.
  template <typename F>
  auto run(F&& f) {
    try {
      auto result = [&] {
        py::gil_scoped_release nogil;
        InterruptScope scope([this] { return check(); });
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

// An engine method as a binding that PythonSignals can interrupt.
template <typename R, typename... A>
auto interruptible(R (Engine::*method)(A...)) {
  return [method](Engine& engine, A... args) {
    return PythonSignals().run([&] { return (engine.*method)(args...); });
  };
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyddp's C++ core. Use the pyddp package, not this module.";
  const auto release = py::call_guard<py::gil_scoped_release>();

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
      .value("MAX", RedOp::Max);

  py::enum_<Algo>(m, "Algo", "How an all-reduce runs: by size (AUTO), or forced.")
      .value("AUTO", Algo::Auto)
      .value("RING", Algo::Ring)
      .value("DIRECT", Algo::Direct)
      .value("TWO_SHOT", Algo::TwoShot);

  py::class_<RingOptions>(m, "RingOptions")
      .def(py::init(&RingOptions::fromEnv), "RingOptions with defaults from PYDDP_* variables.")
      .def(py::init<const RingOptions&>(), "A copy.")
      .def_readwrite("slot_bytes", &RingOptions::slotBytes)
      .def_readwrite("num_slots", &RingOptions::numSlots)
      .def_readwrite("direct_max_bytes", &RingOptions::directMaxBytes)
      .def_readwrite("two_shot_max_bytes", &RingOptions::twoShotMaxBytes)
      .def_readwrite("algo", &RingOptions::algo)
      .def_readwrite("timeout_ms", &RingOptions::timeoutMs)
      .def("validate", &RingOptions::validate);

  m.def("settings", &settings, "Every PYDDP_* environment variable and its value.");

  py::class_<Engine, c10d::Backend, c10::intrusive_ptr<Engine>>(
      m, "Engine", "Runs a group's collectives for the tensors of one device.")
      .def("all_reduce", interruptible(&Engine::allReduce), py::arg("tensor"), py::arg("op"),
           py::arg("async_op"))
      .def("all_gather_single", interruptible(&Engine::allGatherSingle), py::arg("output"),
           py::arg("input"), py::arg("async_op"))
      .def("all_gather", interruptible(&Engine::allGatherList), py::arg("tensor_list"),
           py::arg("tensor"), py::arg("async_op"))
      .def("broadcast", interruptible(&Engine::broadcastFrom), py::arg("tensor"), py::arg("src"),
           py::arg("async_op"))
      .def("reduce_scatter_single", interruptible(&Engine::reduceScatterSingle),
           py::arg("output"), py::arg("input"), py::arg("op"), py::arg("async_op"))
      .def("barrier", interruptible(&Engine::barrierAll), py::arg("async_op"))
      .def("reduce", interruptible(&Engine::reduceTo), py::arg("tensor"), py::arg("op"),
           py::arg("dst"), py::arg("async_op"))
      .def("gather", interruptible(&Engine::gatherTo), py::arg("gather_list"),
           py::arg("tensor"), py::arg("dst"), py::arg("async_op"))
      .def("scatter", interruptible(&Engine::scatterFrom), py::arg("tensor"),
           py::arg("scatter_list"), py::arg("src"), py::arg("async_op"))
      .def("shutdown", &Engine::shutdown, release)
      .def_property_readonly("device", &Engine::device)
      .def_property_readonly("transport", &Engine::transport);

  py::class_<RingEngine, Engine, c10::intrusive_ptr<RingEngine>>(
      m, "RingEngine", "pyddp's ring and direct algorithms over a transport.")
      .def_property_readonly("options", &RingEngine::options);
#ifdef PYDDP_WITH_CUDA
  py::class_<NcclEngine, Engine, c10::intrusive_ptr<NcclEngine>>(
      m, "NcclEngine", "NCCL's own collectives.")
      .def_property_readonly("timeout_ms", [](const NcclEngine& e) { return e.timeout().count(); });
#endif

  m.def(
      "wait",
      [](const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
        return PythonSignals().run([&] { return work->wait(timeout); });
      },
      py::arg("work"), py::arg("timeout"),
      "work.wait(timeout) (0: no limit), interruptible by Python's signal handlers.");
  m.def("join_stopped_workers", &joinStoppedWorkers, release,
        "Joins CPU workers stopped from their own future callbacks (pyddp calls it at exit).");

  m.def("backend_names", &backendNames, "The backend names this build serves.");
  m.def("device_types_of", &deviceTypesOf, py::arg("backend"),
        "The device types (\"cpu\", \"cuda\") a group of `backend` serves.");
  m.def(
      "make_engine",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const RingOptions& options, c10::Device device, const std::string& backend) {
        EngineChoice choice = PythonSignals().run(
            [&] { return makeEngine(store, rank, size, options, device, backend); });
        return std::make_pair(choice.engine, choice.refusals);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), py::arg("device"),
      py::arg("backend"),
      "(engine, refusals): the engine of `backend` for `device`, and why each candidate "
      "before it was passed over.");

#ifdef PYDDP_WITH_TESTING
  testing::bindTesting(m);
#endif
}
