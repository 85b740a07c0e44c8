// A flat buffer's segment table and its split into fixed-size work items.
//
// Why fixed-size items: a reduction over a segment is split into items of kItem elements counted
// from the segment's start, each item is reduced alone and the items of a segment are combined
// in order. The split depends on the table only, never on the number of threads, so every
// result is the same whatever at::get_num_threads() says (bit for bit, also for the float64
// sums of squares), and sizes that do not divide the chunking are ordinary tails.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace mfsdp2 {

// Elements per work item: a multiple of every lane count used by the kernels (8, 16).
constexpr int64_t kItem = 16384;

struct Item {
  int64_t seg;    // segment index
  int64_t begin;  // element range [begin, end) of the flat buffer
  int64_t end;
};

struct SegmentTable {
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  std::vector<Item> items;            // in segment order, then position order
  std::vector<int64_t> first_item;    // items of segment s: [first_item[s], first_item[s + 1])
  int64_t total = 0;                  // elements covered by the segments

  int64_t size() const { return static_cast<int64_t>(offsets.size()); }
};

// Reads and checks ``offsets`` / ``lengths`` (1-D int64 CPU tensors of one length) against a
// buffer of ``numel`` elements (an empty segment's offset is ignored). ``disjoint``: the segments must also be sorted and not overlap
// (kernels that write every position of the buffer need that). Errors name ``what``.
SegmentTable make_table(const at::Tensor& offsets, const at::Tensor& lengths, int64_t numel,
                        bool disjoint, const char* what);

// Runs ``fn(item_index)`` over every item, in parallel (at::parallel_for, torch's thread count)
// when the table covers enough elements to be worth waking threads.
template <typename F>
void for_each_item(const SegmentTable& t, const F& fn);

}  // namespace mfsdp2

#include "segments_inl.h"
