// dcomm: a header-only C++20 communication library for distributed training.
// This header brings in everything that needs no CUDA; GPU support lives
// behind its own include.
#pragma once

#include "dcomm/backend.hpp"
#include "dcomm/communicator.hpp"
#include "dcomm/completion.hpp"
#include "dcomm/cpu_backend.hpp"
#include "dcomm/data_partitioner.hpp"
#include "dcomm/distributed_sampler.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/error.hpp"
#include "dcomm/gradient_bucketer.hpp"
#include "dcomm/half.hpp"
#include "dcomm/init_method.hpp"
#include "dcomm/init_process_group.hpp"
#include "dcomm/reduce_op.hpp"
#include "dcomm/rendezvous.hpp"
#include "dcomm/request.hpp"
#include "dcomm/spawn.hpp"
#include "dcomm/store/file_store.hpp"
#include "dcomm/store/hash_store.hpp"
#include "dcomm/store/prefix_store.hpp"
#include "dcomm/store/store.hpp"
#include "dcomm/store/tcp_store.hpp"
#include "dcomm/tcp_backend.hpp"
#include "dcomm/tensor.hpp"
#include "dcomm/thread_world.hpp"
