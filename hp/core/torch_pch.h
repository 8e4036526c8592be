// The precompiled header of every LibTorch room: the heavy, stable headers.
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>
