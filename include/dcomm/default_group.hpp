// The process's default group, for programs that want one (torch.distributed's
// default process group, MPI's MPI_COMM_WORLD): set by init_process_group's
// `set_default` option or by set_default_group, read from anywhere, cleared
// by destroy_process_group. Opt-in: a program that passes its communicator
// around never has one. Thread-safe.
//
//   dcomm::init_process_group<dcomm::cpu_backend>({.set_default = true});
//   ...
//   if (dcomm::is_initialized() && dcomm::get_rank() == 0) log(...);
//   auto comm = dcomm::default_group<dcomm::cpu_backend>();
//   comm.barrier(dcomm::blocking);
//   dcomm::destroy_process_group();
#pragma once

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>
#include <utility>

#include "dcomm/communicator.hpp"
#include "dcomm/error.hpp"

namespace dcomm {

namespace detail {
// The default group, type-erased: the communicator handle of whichever
// backend was set, with what get_rank and get_world_size answer.
struct default_group_slot {
  std::shared_ptr<void> comm;  // a communicator<B>, B named by `backend`
  const std::type_info* backend = nullptr;
  std::string backend_name;
  int rank = -1;
  int size = 0;
};
// Never destroyed: a slot still set when the program exits is cleared by
// the handler set_default_group registers with std::atexit, which runs
// before the statics made earlier (Asio's) are gone.
inline std::mutex& default_group_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
inline default_group_slot& default_group_state() {
  static auto* slot = new default_group_slot;
  return *slot;
}
inline void clear_default_group_at_exit();
[[noreturn]] inline void no_default_group(const char* call) {
  throw_error(errc::invalid_argument,
              {.operation = call,
               .detail = "there is no default group: pass init_process_group's "
                         "set_default = true, or call dcomm::set_default_group(comm)"});
}
// Takes the slot's handle out, so that the last handle goes (and its
// connections close) outside the lock.
inline std::shared_ptr<void> take_default_group() {
  std::lock_guard lock(default_group_mutex());
  auto& s = default_group_state();
  auto comm = std::move(s.comm);
  s = {};
  return comm;
}
}  // namespace detail

// Makes `comm` the default group, replacing any other. The slot holds a
// handle: the group's connections stay open until destroy_process_group
// (or another set_default_group) and the program's own handles are gone.
template <backend Backend>
void set_default_group(const communicator<Backend>& comm) {
  if (!comm.valid())
    throw_error(errc::invalid_argument,
                {.operation = "set_default_group", .detail = "an empty communicator handle"});
  auto held = std::make_shared<communicator<Backend>>(comm);
  std::shared_ptr<void> previous;  // goes after the lock is released
  {
    std::lock_guard lock(detail::default_group_mutex());
    auto& s = detail::default_group_state();
    previous = std::move(s.comm);
    s = {std::move(held), &typeid(Backend), std::string(Backend::name), comm.rank(), comm.size()};
  }
  detail::clear_default_group_at_exit();
}

// Whether there is a default group (torch.distributed.is_initialized).
inline bool is_initialized() {
  std::lock_guard lock(detail::default_group_mutex());
  return detail::default_group_state().comm != nullptr;
}

// The default group's rank and size (torch.distributed.get_rank and
// get_world_size without a group); errc::invalid_argument without one.
inline int get_rank() {
  std::lock_guard lock(detail::default_group_mutex());
  const auto& s = detail::default_group_state();
  if (!s.comm) detail::no_default_group("get_rank");
  return s.rank;
}
inline int get_world_size() {
  std::lock_guard lock(detail::default_group_mutex());
  const auto& s = detail::default_group_state();
  if (!s.comm) detail::no_default_group("get_world_size");
  return s.size;
}

// A handle to the default group; errc::invalid_argument without one, or
// when it is another backend's.
template <backend Backend>
communicator<Backend> default_group() {
  std::lock_guard lock(detail::default_group_mutex());
  const auto& s = detail::default_group_state();
  if (!s.comm) detail::no_default_group("default_group");
  if (*s.backend != typeid(Backend))
    throw_error(errc::invalid_argument,
                {.operation = "default_group",
                 .expected = "a group of the " + std::string(Backend::name) + " backend",
                 .seen = "one of the " + s.backend_name + " backend"});
  return *static_cast<const communicator<Backend>*>(s.comm.get());
}

// Clears the default group (torch.distributed.destroy_process_group): its
// handle goes; the connections close once the program's handles of the
// group are gone too. is_initialized() is false after it; calling it
// without a default group does nothing. A default group left set when the
// program exits is destroyed then.
inline void destroy_process_group() {
  detail::take_default_group().reset();
}

// A program that exits with a default group closes it as its own last
// handle would (links flushed and closed, bounded), not by the OS.
inline void detail::clear_default_group_at_exit() {
  static const bool registered = [] {
    std::atexit([] { destroy_process_group(); });
    return true;
  }();
  (void)registered;
}

}  // namespace dcomm
