// Containers of the TCP transport that keep their memory between calls, so
// that an operation in steady state allocates nothing: a FIFO over a
// vector (a std::deque allocates a block every few elements as it moves),
// and pools of vectors and objects that calls borrow and give back.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace dcomm::cpu {

// First in, first out, over a vector that keeps its capacity. Elements may
// move when it grows: hold indexes, not addresses.
template <class T>
class fifo {
 public:
  bool empty() const { return head_ == items_.size(); }
  std::size_t size() const { return items_.size() - head_; }
  T& operator[](std::size_t i) { return items_[head_ + i]; }
  const T& operator[](std::size_t i) const { return items_[head_ + i]; }
  T& front() { return items_[head_]; }
  void push_back(T v) { items_.push_back(std::move(v)); }
  void pop_front(std::size_t n = 1) {
    head_ += n;
    if (head_ == items_.size()) {
      items_.clear();
      head_ = 0;
    } else if (head_ >= 64 && head_ * 2 >= items_.size()) {
      // A queue that never drains: move the live part to the front
      // rather than grow for ever.
      items_.erase(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(head_));
      head_ = 0;
    }
  }
  // Keeps the first n elements.
  void truncate(std::size_t n) {
    items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(head_ + n), items_.end());
  }

 private:
  std::vector<T> items_;
  std::size_t head_ = 0;
};

// Vectors lent to calls (scratch memory, lists of items). A returned vector
// keeps its size; the pool holds at most `max_spare` of them, dropping the
// smallest, so what it holds is bounded by the largest recent calls.
template <class T>
class vector_pool {
 public:
  static constexpr std::size_t max_spare = 8;

  // A vector of at least n elements: the smallest spare one that is large
  // enough, else the largest grown to n.
  std::vector<T> take(std::size_t n) {
    std::vector<T> v;
    auto fits = std::find_if(spare_.begin(), spare_.end(), [n](auto& s) { return s.size() >= n; });
    if (fits == spare_.end() && !spare_.empty()) fits = spare_.end() - 1;
    if (fits != spare_.end()) {
      v = std::move(*fits);
      spare_.erase(fits);
    }
    if (v.size() < n) v.resize(n);
    return v;
  }
  void give_back(std::vector<T> v) {
    if (v.empty()) return;
    auto at = std::lower_bound(spare_.begin(), spare_.end(), v.size(),
                               [](auto& s, std::size_t size) { return s.size() < size; });
    spare_.insert(at, std::move(v));
    if (spare_.size() > max_spare) spare_.erase(spare_.begin());
  }

 private:
  std::vector<std::vector<T>> spare_;  // by size, smallest first
};

// A vector borrowed from a pool for one call, given back when it goes out
// of scope. An algorithm that sends from or receives into it must
// wait_all() before it goes.
template <class T>
class pooled_vector {
 public:
  explicit pooled_vector(vector_pool<T>& pool) : pool_(&pool) {}
  pooled_vector(const pooled_vector&) = delete;
  pooled_vector& operator=(const pooled_vector&) = delete;
  ~pooled_vector() {
    if (taken_) pool_->give_back(std::move(v_));
  }
  // At least n elements; earlier contents are kept only if no growth.
  T* get(std::size_t n) {
    if (!taken_) {
      v_ = pool_->take(n);
      taken_ = true;
    } else if (v_.size() < n) {
      v_.resize(n);
    }
    return v_.data();
  }

 private:
  vector_pool<T>* pool_;
  std::vector<T> v_;
  bool taken_ = false;
};

// Objects recycled through a free list, made 16 at a time: a pool that
// reaches a new high-water mark allocates once per 16 objects. The pool
// owns them all; what they hold is the caller's to reset (a kept buffer
// is the point of recycling some of them).
template <class T>
class object_pool {
 public:
  static constexpr std::size_t block_size = 16;

  T* take() {
    if (spare_.empty()) grow();
    T* p = spare_.back();
    spare_.pop_back();
    return p;
  }
  void give_back(T* p) { spare_.push_back(p); }  // never beyond its capacity

 private:
  void grow() {
    blocks_.push_back(std::make_unique<T[]>(block_size));
    spare_.reserve(blocks_.size() * block_size);
    for (std::size_t i = block_size; i-- > 0;) spare_.push_back(&blocks_.back()[i]);
  }

  std::vector<std::unique_ptr<T[]>> blocks_;
  std::vector<T*> spare_;
};

}  // namespace dcomm::cpu
