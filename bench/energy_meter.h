// bench/energy_meter.h
// \brief The GPU's energy counter, for `flashkit_bench --energy`: NVML's total energy since the
// driver loaded (millijoules), read through libnvidia-ml loaded at run time, so that the benchmark
// neither links NVML nor needs its headers (the library ships with the driver).
//
// Why energy: on random inputs the sm90 forward draws more than the board's power limit and the
// clock follows the power cap (bench/NOTES.md, "Session 10"), so its time moves with the GPU's
// power state, while the energy a call takes is what a change to the kernel moves.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <string>

namespace flashkit::bench {

class EnergyMeter {
 public:
  // The meter of CUDA device `cuda_device` (matched to NVML's by PCI bus id).
  explicit EnergyMeter(int cuda_device) {
    library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library_ == nullptr) {
      why_not_ = "libnvidia-ml.so.1 not found";
      return;
    }
    using Init = int (*)();
    using HandleByBusId = int (*)(const char*, void**);
    const auto init = reinterpret_cast<Init>(dlsym(library_, "nvmlInit_v2"));
    const auto handle_by_bus_id = reinterpret_cast<HandleByBusId>(dlsym(library_, "nvmlDeviceGetHandleByPciBusId_v2"));
    total_energy_ = reinterpret_cast<TotalEnergy>(dlsym(library_, "nvmlDeviceGetTotalEnergyConsumption"));
    char bus_id[64] = {};
    if (init == nullptr || handle_by_bus_id == nullptr || total_energy_ == nullptr) {
      why_not_ = "libnvidia-ml.so.1 lacks the energy counter's functions";
    } else if (init() != 0) {
      why_not_ = "nvmlInit failed";
    } else if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess ||
               handle_by_bus_id(bus_id, &device_) != 0) {
      why_not_ = "no NVML device for CUDA device " + std::to_string(cuda_device);
    } else if (millijoules() < 0) {
      why_not_ = "this GPU has no total-energy counter";
    }
  }
  EnergyMeter(const EnergyMeter&) = delete;
  EnergyMeter& operator=(const EnergyMeter&) = delete;
  ~EnergyMeter() {
    if (library_ != nullptr) dlclose(library_);  // (nvmlShutdown is not needed at exit)
  }

  bool available() const { return why_not_.empty(); }
  const std::string& why_not() const { return why_not_; }

  // Energy since the driver loaded, in millijoules; -1 if it cannot be read.
  double millijoules() const {
    unsigned long long mj = 0;
    if (total_energy_ == nullptr || device_ == nullptr || total_energy_(device_, &mj) != 0) return -1;
    return static_cast<double>(mj);
  }

 private:
  using TotalEnergy = int (*)(void*, unsigned long long*);
  void* library_ = nullptr;
  void* device_ = nullptr;
  TotalEnergy total_energy_ = nullptr;
  std::string why_not_;
};

}  // namespace flashkit::bench
