// flashkit/flashkit.h: the whole public C++ API.
#pragma once

#include "flashkit/api.h"
#include "flashkit/error.h"
#include "flashkit/kvcache_params.h"
#include "flashkit/nsa_params.h"
#include "flashkit/params.h"
#include "flashkit/tensor.h"
