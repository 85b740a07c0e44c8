#include "segments.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace mfsdp2 {

SegmentTable make_table(const at::Tensor& offsets, const at::Tensor& lengths, int64_t numel,
                        const char* what) {
  TORCH_CHECK(offsets.dim() == 1 && lengths.dim() == 1 && offsets.numel() == lengths.numel(),
              what, ": offsets and lengths must be 1-D tensors of one length, got ", offsets.sizes(),
              " and ", lengths.sizes());
  TORCH_CHECK(offsets.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                  offsets.device().is_cpu() && lengths.device().is_cpu(),
              what, ": offsets and lengths must be int64 CPU tensors");
  at::Tensor o = offsets.contiguous(), l = lengths.contiguous();
  const int64_t n = o.numel();
  SegmentTable t;
  t.offsets.assign(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + n);
  t.lengths.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + n);
  int64_t end_prev = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t off = t.offsets[s], len = t.lengths[s];
    TORCH_CHECK(len >= 0, what, ": segment ", s, " has a negative length (", len, ")");
    // An empty segment's offset is not used (an empty piece of a shard reports where its rows
    // would start, which may lie past the shard's end).
    TORCH_CHECK(len == 0 || (off >= 0 && off <= numel && len <= numel - off), what, ": segment ", s,
                " (offset ", off, ", length ", len, ") lies outside the buffer of ", numel, " elements");
    if (len > 0) {
      TORCH_CHECK(off >= end_prev, what, ": segment ", s, " (offset ", off,
                  ") overlaps or precedes the previous one (ending at ", end_prev,
                  "); segments must be sorted and disjoint");
      end_prev = off + len;
    }
    for (int64_t b = off; b < off + len; b += kItem) {
      t.items.push_back({s, b, std::min(b + kItem, off + len)});
    }
    t.total += len;
  }
  return t;
}

}  // namespace mfsdp2
