// src/cuda/sm90/tile_counter_slots.cpp
// \brief One tile-counter slot per (device, stream) that launches (see tile_counter_slots.h).
#include "cuda/sm90/tile_counter_slots.h"

#include <map>
#include <mutex>
#include <utility>

namespace flashkit::sm90 {

int tile_counter_slot(int device, void* stream) {
  static std::mutex mutex;
  static std::map<std::pair<int, void*>, int> slots;
  static std::map<int, int> taken;  // slots handed out per device
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, stream);
  const auto found = slots.find(key);
  if (found != slots.end()) return found->second;
  int& count = taken[device];
  if (count == kTileCounterSlots) return -1;
  slots.emplace(key, count);
  return count++;
}

}  // namespace flashkit::sm90
