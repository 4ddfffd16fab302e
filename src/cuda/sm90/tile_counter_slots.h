// src/cuda/sm90/tile_counter_slots.h
// \brief Which of a kernel's tile counters a launch uses (the sm90 forward's dynamic tile
// scheduler). Host code.
//
// A persistent CTA that has finished a tile takes the next one from a counter in global memory
// that every CTA of its launch adds to. The counter must read 0 when the launch starts: it is a
// zero-initialised __device__ array, and the launch's last taker stores 0 back (fwd_kernel_sm90.cuh),
// so launches that follow one another may share a counter, but launches that may run at the same
// time may not. Launches on one stream follow one another; so each (device, stream) that launches
// gets a slot of its own, for as long as the process lives. A stream handle that is destroyed and
// reused keeps its slot, which is harmless: the streams behind it never run at the same time. The
// per-thread default stream (cudaStreamPerThread) is one handle for a different stream in each host
// thread, so there the calling thread is part of the key.
#pragma once

namespace flashkit::sm90 {

constexpr int kTileCounterSlots = 256;

// The slot of (device, cudaStream_t `stream`), or -1 when every slot is taken (the launch then
// runs one CTA per tile, which needs no counter). Thread-safe.
int tile_counter_slot(int device, void* stream);

}  // namespace flashkit::sm90
