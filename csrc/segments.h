// A flat buffer's segment table and its split into work items for the threads.
//
// Each segment is cut into items of kItem elements counted from its start (the last one
// shorter), and the threads (at::parallel_for, torch's thread count) take whole items. The split
// depends on the table only, never on the number of threads, and every kernel is elementwise
// within an item, so any thread count writes the same bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace mfsdp2 {

// Elements per work item (64 KiB of float32): large enough that a thread's start-up is noise.
constexpr int64_t kItem = 16384;

struct Item {
  int64_t seg;    // segment index
  int64_t begin;  // element range [begin, end) of the flat buffer
  int64_t end;
};

struct SegmentTable {
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  std::vector<Item> items;  // in segment order, then position order
  int64_t total = 0;        // elements covered by the segments

  int64_t size() const { return static_cast<int64_t>(offsets.size()); }
};

// Reads and checks ``offsets`` / ``lengths`` (1-D int64 CPU tensors of one length) against a
// buffer of ``numel`` elements: non-empty segments must lie inside it, sorted and disjoint
// (threads write them); an empty segment's offset is ignored. Errors name ``what``.
SegmentTable make_table(const at::Tensor& offsets, const at::Tensor& lengths, int64_t numel,
                        const char* what);

// Runs ``fn(item_index)`` over every item, in parallel (at::parallel_for, torch's thread count)
// when the table covers enough elements to be worth waking threads.
template <typename F>
void for_each_item(const SegmentTable& t, const F& fn);

}  // namespace mfsdp2

#include "segments_inl.h"
