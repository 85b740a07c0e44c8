#pragma once

#include <ATen/Parallel.h>

namespace mfsdp2 {

template <typename F>
void for_each_item(const SegmentTable& t, const F& fn) {
  const int64_t n = static_cast<int64_t>(t.items.size());
  // Below ~4 items the threads' wake-up costs more than the work.
  const int64_t grain = t.total >= 4 * kItem ? 1 : (n > 0 ? n : 1);
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

}  // namespace mfsdp2
