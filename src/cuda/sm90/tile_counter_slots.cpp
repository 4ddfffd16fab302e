// src/cuda/sm90/tile_counter_slots.cpp
// \brief One tile-counter slot per (device, stream) that launches (see tile_counter_slots.h).
#include "cuda/sm90/tile_counter_slots.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <thread>
#include <tuple>

namespace flashkit::sm90 {

int tile_counter_slot(int device, void* stream) {
  static std::mutex mutex;
  static std::map<std::tuple<int, void*, std::thread::id>, int> slots;
  static std::map<int, int> taken;  // slots handed out per device
  const bool per_thread = stream == static_cast<void*>(cudaStreamPerThread);
  const auto key = std::make_tuple(device, stream, per_thread ? std::this_thread::get_id() : std::thread::id());
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = slots.find(key);
  if (found != slots.end()) return found->second;
  int& count = taken[device];
  if (count == kTileCounterSlots) return -1;
  slots.emplace(key, count);
  return count++;
}

}  // namespace flashkit::sm90
