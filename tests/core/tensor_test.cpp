// Tests for the tensor concepts, tensor_traits and the type-erased views.
#include <doctest/doctest.h>
#include <dcomm/tensor.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// In an anonymous namespace: all unit tests link into one executable.
namespace {
namespace user {

// Typed through traits, on a (pretend) GPU. data() takes only a non-const
// reference, like most real tensor classes' accessors.
struct typed_tensor {
  std::vector<float> storage;
  int gpu = 0;
};

// Runtime-typed through traits.
struct runtime_tensor {
  void* ptr = nullptr;
  std::size_t n = 0;
  dcomm::dtype type = dcomm::dtype::uint8;
};

// Traits whose data() always hands out read-only memory.
struct readonly_tensor {
  const double* ptr = nullptr;
  std::size_t n = 0;
};

// A handle with shallow constness: a const handle still writes its data.
struct shallow_handle {
  std::int64_t* ptr = nullptr;
  std::size_t n = 0;
};

// void* without a dtype() is not enough.
struct untyped_without_dtype {
  void* ptr = nullptr;
  std::size_t n = 0;
};

// Traits without size().
struct traits_without_size {
  float* ptr = nullptr;
};

// Traits with an unsupported element type.
struct traits_short_elements {
  std::int16_t* ptr = nullptr;
};

// Plain members, const-correct.
class with_members {
 public:
  explicit with_members(std::size_t n) : values_(n) {}
  std::int32_t* data() { return values_.data(); }
  const std::int32_t* data() const { return values_.data(); }
  std::size_t size() const { return values_.size(); }

 private:
  std::vector<std::int32_t> values_;
};

// Only a non-const data(): usable when non-const, not at all when const.
struct only_mutable_member {
  float value = 0;
  float* data() { return &value; }
  std::size_t size() const { return 1; }
};

struct members_short_elements {
  std::int16_t* data() { return nullptr; }
  std::size_t size() const { return 0; }
};

struct members_without_pointer {
  int data() const { return 0; }
  std::size_t size() const { return 0; }
};

// Has both; the traits specialisation wins (it says 2 elements, not 4).
struct traits_and_members {
  std::array<dcomm::bfloat16, 4> values{};
  dcomm::bfloat16* data() { return values.data(); }
  std::size_t size() const { return values.size(); }
};

}  // namespace user
}  // namespace

template <>
struct dcomm::tensor_traits<user::typed_tensor> {
  static float* data(user::typed_tensor& t) { return t.storage.data(); }
  static std::size_t size(const user::typed_tensor& t) { return t.storage.size(); }
  static dcomm::device device(const user::typed_tensor& t) { return dcomm::device::cuda(t.gpu); }
};

template <>
struct dcomm::tensor_traits<user::runtime_tensor> {
  static void* data(user::runtime_tensor& t) { return t.ptr; }
  static std::size_t size(const user::runtime_tensor& t) { return t.n; }
  static dcomm::dtype dtype(const user::runtime_tensor& t) { return t.type; }
};

template <>
struct dcomm::tensor_traits<user::readonly_tensor> {
  static const double* data(const user::readonly_tensor& t) { return t.ptr; }
  static std::size_t size(const user::readonly_tensor& t) { return t.n; }
};

template <>
struct dcomm::tensor_traits<user::shallow_handle> {
  static std::int64_t* data(const user::shallow_handle& t) { return t.ptr; }
  static std::size_t size(const user::shallow_handle& t) { return t.n; }
};

template <>
struct dcomm::tensor_traits<user::untyped_without_dtype> {
  static void* data(user::untyped_without_dtype& t) { return t.ptr; }
  static std::size_t size(const user::untyped_without_dtype& t) { return t.n; }
};

template <>
struct dcomm::tensor_traits<user::traits_without_size> {
  static float* data(user::traits_without_size& t) { return t.ptr; }
};

template <>
struct dcomm::tensor_traits<user::traits_short_elements> {
  static std::int16_t* data(user::traits_short_elements& t) { return t.ptr; }
  static std::size_t size(const user::traits_short_elements&) { return 0; }
};

template <>
struct dcomm::tensor_traits<user::traits_and_members> {
  static dcomm::bfloat16* data(user::traits_and_members& t) { return t.values.data(); }
  static std::size_t size(const user::traits_and_members&) { return 2; }
};

namespace {

using dcomm::mutable_tensor;
using dcomm::tensor;

// tensor<T> and mutable_tensor<T> for T, const T, T&, const T&, T&&.
template <class T>
constexpr bool readable_in_all_forms =
    tensor<T>&& tensor<const T>&& tensor<T&>&& tensor<const T&>&& tensor<T&&>;
template <class T>
constexpr bool writable_unless_const =
    mutable_tensor<T>&& mutable_tensor<T&>&& mutable_tensor<T&&> && !mutable_tensor<const T> &&
    !mutable_tensor<const T&>;
template <class T>
constexpr bool never_a_tensor = !tensor<T> && !tensor<const T> && !tensor<T&> &&
                                !tensor<const T&> && !mutable_tensor<T> && !mutable_tensor<T&>;

}  // namespace

TEST_CASE("standard containers and arrays are tensors; const ones are read-only") {
  static_assert(readable_in_all_forms<std::vector<float>>);
  static_assert(writable_unless_const<std::vector<float>>);
  static_assert(readable_in_all_forms<std::vector<dcomm::float16>>);
  static_assert(writable_unless_const<std::vector<std::uint8_t>>);

  static_assert(readable_in_all_forms<std::array<double, 3>>);
  static_assert(writable_unless_const<std::array<double, 3>>);
  static_assert(readable_in_all_forms<std::array<std::int8_t, 0>>);

  static_assert(readable_in_all_forms<float[4]>);
  static_assert(writable_unless_const<float[4]>);
  static_assert(writable_unless_const<std::int64_t[1]>);
  static_assert(tensor<const std::int32_t(&)[2]> && !mutable_tensor<const std::int32_t(&)[2]>);

  static_assert(std::is_same_v<dcomm::element_t<std::vector<float>>, float>);
  static_assert(std::is_same_v<dcomm::element_t<const std::vector<float>&>, float>);
  static_assert(std::is_same_v<dcomm::element_t<std::array<double, 3>>, double>);
  static_assert(std::is_same_v<dcomm::element_t<const std::int8_t(&)[4]>, std::int8_t>);
  CHECK(true);
}

TEST_CASE("spans: the element constness decides, not the span's own constness") {
  static_assert(readable_in_all_forms<std::span<float>>);
  static_assert(mutable_tensor<std::span<float>>);
  // A const span still refers to writable floats.
  static_assert(mutable_tensor<const std::span<float>&>);
  static_assert(mutable_tensor<std::span<float, 3>>);

  static_assert(readable_in_all_forms<std::span<const float>>);
  static_assert(!mutable_tensor<std::span<const float>>);
  static_assert(!mutable_tensor<std::span<const float>&>);
  static_assert(!mutable_tensor<std::span<const float>&&>);
  static_assert(!mutable_tensor<std::span<const double, 2>>);

  static_assert(std::is_same_v<dcomm::element_t<std::span<const double>>, double>);
  static_assert(tensor<std::initializer_list<float>> &&
                !mutable_tensor<std::initializer_list<float>>);
  CHECK(true);
}

TEST_CASE("things that are not tensors") {
  static_assert(never_a_tensor<std::vector<bool>>);          // no data(), not contiguous
  static_assert(never_a_tensor<std::vector<std::int16_t>>);  // no dtype
  static_assert(never_a_tensor<std::vector<std::uint32_t>>);
  static_assert(never_a_tensor<std::vector<long double>>);
  static_assert(never_a_tensor<std::vector<char>>);
  static_assert(never_a_tensor<std::string>);
  static_assert(never_a_tensor<std::string_view>);
  static_assert(never_a_tensor<std::list<float>>);  // not contiguous
  static_assert(never_a_tensor<std::deque<float>>);
  static_assert(never_a_tensor<std::map<int, float>>);
  static_assert(never_a_tensor<std::vector<std::vector<float>>>);
  static_assert(never_a_tensor<std::span<std::int16_t>>);
  static_assert(never_a_tensor<std::int16_t[4]>);
  static_assert(never_a_tensor<float>);
  static_assert(never_a_tensor<float*>);
  static_assert(never_a_tensor<const float*>);
  static_assert(never_a_tensor<int>);
  static_assert(!tensor<void>);
  static_assert(!tensor<void()>);
  static_assert(!tensor<volatile float[2]>);
  CHECK(true);
}

TEST_CASE("user types: tensor_traits, members, and what is missing") {
  // Typed traits with data(T&) only: a const object is still readable.
  static_assert(readable_in_all_forms<user::typed_tensor>);
  static_assert(writable_unless_const<user::typed_tensor>);
  static_assert(std::is_same_v<dcomm::element_t<user::typed_tensor>, float>);

  // Runtime-typed traits.
  static_assert(readable_in_all_forms<user::runtime_tensor>);
  static_assert(writable_unless_const<user::runtime_tensor>);
  static_assert(std::is_same_v<dcomm::element_t<user::runtime_tensor>, void>);

  // Traits returning const data: never writable.
  static_assert(readable_in_all_forms<user::readonly_tensor>);
  static_assert(!mutable_tensor<user::readonly_tensor>);
  static_assert(!mutable_tensor<user::readonly_tensor&>);
  static_assert(!mutable_tensor<user::readonly_tensor&&>);
  static_assert(std::is_same_v<dcomm::element_t<user::readonly_tensor>, double>);

  // Traits taking const T& and returning a writable pointer: shallow const.
  static_assert(mutable_tensor<const user::shallow_handle&>);

  // Broken specialisations are not silently replaced by another route.
  static_assert(never_a_tensor<user::untyped_without_dtype>);
  static_assert(never_a_tensor<user::traits_without_size>);
  static_assert(never_a_tensor<user::traits_short_elements>);

  // Members.
  static_assert(readable_in_all_forms<user::with_members>);
  static_assert(writable_unless_const<user::with_members>);
  static_assert(std::is_same_v<dcomm::element_t<user::with_members>, std::int32_t>);
  static_assert(mutable_tensor<user::only_mutable_member&>);
  static_assert(!tensor<const user::only_mutable_member&>);
  static_assert(never_a_tensor<user::members_short_elements>);
  static_assert(never_a_tensor<user::members_without_pointer>);

  static_assert(writable_unless_const<user::traits_and_members>);
  CHECK(true);
}

TEST_CASE("the views are runtime-typed tensors themselves") {
  static_assert(readable_in_all_forms<dcomm::tensor_view>);
  static_assert(mutable_tensor<dcomm::tensor_view>);
  static_assert(mutable_tensor<const dcomm::tensor_view&>);  // shallow, like span
  static_assert(std::is_same_v<dcomm::element_t<dcomm::tensor_view>, void>);
  static_assert(readable_in_all_forms<dcomm::const_tensor_view>);
  static_assert(!mutable_tensor<dcomm::const_tensor_view>);
  static_assert(!mutable_tensor<dcomm::const_tensor_view&>);

  std::int64_t data[3] = {};
  const dcomm::tensor_view tv{data, 3, dcomm::dtype::int64, dcomm::device::cuda(1)};
  const dcomm::tensor_view again = dcomm::mutable_view(tv);
  CHECK(again.data == data);
  CHECK(again.count == 3);
  CHECK(again.type == dcomm::dtype::int64);
  CHECK(again.device == dcomm::device::cuda(1));
  const dcomm::const_tensor_view cv = dcomm::view(dcomm::const_tensor_view(tv));
  CHECK(cv.data == data);
  CHECK(cv.count == 3);
  CHECK(cv.type == dcomm::dtype::int64);
  CHECK(cv.device == dcomm::device::cuda(1));
  CHECK(cv.bytes() == 24);
}

TEST_CASE("device") {
  constexpr dcomm::device d{};
  static_assert(d.type == dcomm::device::kind::cpu && d.index == 0);
  static_assert(dcomm::device::cpu() == d);
  static_assert(dcomm::device::cuda(3).type == dcomm::device::kind::cuda);
  static_assert(dcomm::device::cuda(3).index == 3);
  static_assert(dcomm::device::cuda().index == 0);
  static_assert(dcomm::device::cuda(1) != dcomm::device::cuda(2));
  static_assert(dcomm::device::cuda(0) != dcomm::device::cpu());
  static_assert(std::is_trivially_copyable_v<dcomm::device>);
  CHECK(dcomm::device::cuda(1) == dcomm::device{dcomm::device::kind::cuda, 1});
}

TEST_CASE("views of standard containers") {
  std::vector<std::int32_t> v{1, 2, 3, 4, 5};
  const dcomm::const_tensor_view cv = dcomm::view(v);
  CHECK(cv.data == v.data());
  CHECK(cv.count == 5);
  CHECK(cv.type == dcomm::dtype::int32);
  CHECK(cv.device == dcomm::device::cpu());
  CHECK(cv.bytes() == 20);

  const dcomm::tensor_view mv = dcomm::mutable_view(v);
  CHECK(mv.data == v.data());
  CHECK(mv.count == 5);
  CHECK(mv.type == dcomm::dtype::int32);
  CHECK(mv.bytes() == 20);
  static_cast<std::int32_t*>(mv.data)[4] = 50;
  CHECK(v[4] == 50);

  // Writable views convert to read-only ones.
  const dcomm::const_tensor_view from_mutable = mv;
  CHECK(from_mutable.data == v.data());
  CHECK(from_mutable.count == 5);
  CHECK(from_mutable.type == dcomm::dtype::int32);

  const std::vector<double> cd(3);
  CHECK(dcomm::view(cd).data == cd.data());
  CHECK(dcomm::view(cd).type == dcomm::dtype::float64);
  CHECK(dcomm::view(cd).bytes() == 24);

  std::array<dcomm::float16, 6> a{};
  CHECK(dcomm::mutable_view(a).data == a.data());
  CHECK(dcomm::mutable_view(a).type == dcomm::dtype::float16);
  CHECK(dcomm::mutable_view(a).bytes() == 12);

  std::uint8_t raw[7] = {};
  CHECK(dcomm::mutable_view(raw).data == raw);
  CHECK(dcomm::mutable_view(raw).count == 7);
  CHECK(dcomm::mutable_view(raw).type == dcomm::dtype::uint8);
  const std::int8_t craw[3] = {};
  CHECK(dcomm::view(craw).data == craw);
  CHECK(dcomm::view(craw).type == dcomm::dtype::int8);

  // Rvalues: a temporary span is fine, and so is a temporary container.
  std::vector<float> f(10);
  const dcomm::tensor_view sub = dcomm::mutable_view(std::span<float>(f).subspan(2, 3));
  CHECK(sub.data == f.data() + 2);
  CHECK(sub.count == 3);
  CHECK(sub.type == dcomm::dtype::float32);
  CHECK(dcomm::view(std::span<const float>(f)).count == 10);
  CHECK(dcomm::mutable_view(std::vector<dcomm::bfloat16>(4)).count == 4);
  CHECK(dcomm::view(std::vector<dcomm::bfloat16>(4)).type == dcomm::dtype::bfloat16);

  std::vector<std::int64_t> empty;
  CHECK(dcomm::view(empty).count == 0);
  CHECK(dcomm::view(empty).bytes() == 0);
  CHECK(dcomm::view(empty).type == dcomm::dtype::int64);
}

TEST_CASE("views of user types") {
  user::typed_tensor t{{1.0f, 2.0f, 3.0f}, 2};
  const dcomm::tensor_view tv = dcomm::mutable_view(t);
  CHECK(tv.data == t.storage.data());
  CHECK(tv.count == 3);
  CHECK(tv.type == dcomm::dtype::float32);
  CHECK(tv.device == dcomm::device::cuda(2));
  const user::typed_tensor& ct = t;
  CHECK(dcomm::view(ct).data == t.storage.data());
  CHECK(dcomm::view(ct).device == dcomm::device::cuda(2));

  alignas(8) std::byte storage[16] = {};
  user::runtime_tensor r{storage, 8, dcomm::dtype::float16};
  const dcomm::tensor_view rv = dcomm::mutable_view(r);
  CHECK(rv.data == storage);
  CHECK(rv.count == 8);
  CHECK(rv.type == dcomm::dtype::float16);
  CHECK(rv.bytes() == 16);
  CHECK(rv.device == dcomm::device::cpu());
  r.type = dcomm::dtype::int64;
  r.n = 2;
  CHECK(dcomm::view(std::as_const(r)).type == dcomm::dtype::int64);
  CHECK(dcomm::view(std::as_const(r)).bytes() == 16);

  const double values[2] = {1, 2};
  const user::readonly_tensor ro{values, 2};
  CHECK(dcomm::view(ro).data == values);
  CHECK(dcomm::view(ro).type == dcomm::dtype::float64);

  std::int64_t slots[4] = {};
  const user::shallow_handle h{slots, 4};
  CHECK(dcomm::mutable_view(h).data == slots);
  CHECK(dcomm::mutable_view(h).type == dcomm::dtype::int64);

  user::with_members m(6);
  CHECK(dcomm::mutable_view(m).data == m.data());
  CHECK(dcomm::mutable_view(m).count == 6);
  CHECK(dcomm::view(std::as_const(m)).type == dcomm::dtype::int32);

  user::traits_and_members both;
  CHECK(dcomm::view(both).count == 2);  // from the traits, not size()
  CHECK(dcomm::view(both).type == dcomm::dtype::bfloat16);
}
