// Capture of a whole train step (forward + autograd backward) into a `Graph`:
// the public entry point. The mechanism lives in capture.cpp alone (see
// NOTE [Capture through a mode key] there) so that it can be swapped.
#pragma once

#include <torch/nn/module.h>

#include <functional>

#include "hp/compile/graph.h"

namespace hp::compile {

/// A train step as the user writes it: runs the model and returns the scalar
/// loss. It may call `loss.backward()` itself; if it does not, capture takes
/// the gradients with torch::autograd::grad. No optimizer step inside.
using TrainFn = std::function<at::Tensor(torch::nn::Module& model, const at::Tensor& input,
                                         const at::Tensor& label)>;

/// Runs `train_fn(model, input, label)` once, eagerly, recording every ATen
/// operator of the forward and of the backward, and returns the graph:
/// placeholders for the model's parameters (one per distinct tensor, first
/// FQN as name), buffers, `input` and `label`; the Output returns the loss and
/// one gradient per parameter FQN (model.named_parameters() order; a shared
/// parameter repeats its gradient; an unused one gets zeros). The model's
/// `.grad`s are left as they were. Not reentrant on one thread.
Graph capture_train_step(torch::nn::Module& model, const TrainFn& train_fn, const at::Tensor& input,
                         const at::Tensor& label);

/// The tensors to replay a captured graph with: for each placeholder, the
/// model's parameter or buffer of that FQN (its current value) or input/label.
std::vector<at::Tensor> placeholder_values(const Graph& graph, torch::nn::Module& model,
                                           const at::Tensor& input, const at::Tensor& label);

}  // namespace hp::compile
