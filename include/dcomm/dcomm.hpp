// dcomm: a header-only C++20 communication library for distributed training.
// This header brings in everything that needs no CUDA; GPU support lives
// behind its own include.
#pragma once

#include "dcomm/backend.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/data_partitioner.hpp"
#include "dcomm/default_group.hpp"
#include "dcomm/distributed_sampler.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/gradient_bucketer.hpp"
#include "dcomm/half.hpp"
#include "dcomm/init_method.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/log.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/rendezvous.hpp"
#include "dcomm/request.hpp"
#include "dcomm/spawn.hpp"
#include "dcomm/store/c10d_store.hpp"
#include "dcomm/store/file_store.hpp"
#include "dcomm/store/hash_store.hpp"
#include "dcomm/store/prefix_store.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/store/tcp_store.hpp"
#include "dcomm/tcp_backend.hpp"
#include "dcomm/tensor.hpp"
#include "dcomm/thread_world.hpp"

// Separate compilation (detail/asio.hpp): the start-up of the CPU backend,
// the coroutines init_process_group<cpu_backend> runs, compiled once in
// the library. Written by hand: they are templates of the backend.
// clang-format off
DCOMM_INSTANTIATE(asio::awaitable<dcomm::communicator<dcomm::cpu_backend>> dcomm::detail::init_from_method<dcomm::cpu_backend>(init_options<cpu_backend>, std::shared_ptr<io_thread>))
DCOMM_INSTANTIATE(asio::awaitable<dcomm::communicator<dcomm::cpu_backend>> dcomm::detail::init_from_store<dcomm::cpu_backend>(std::shared_ptr<store>, int, int, init_options<cpu_backend>, std::shared_ptr<io_thread>))
DCOMM_INSTANTIATE(dcomm::communicator<dcomm::cpu_backend> dcomm::init_process_group<dcomm::cpu_backend>(init_options<cpu_backend>))
// clang-format on
