"""Ordinary inputs that cannot work are a clear error naming what to do, not
an IndexError or a failure deep inside torch or transformers: a compiled or
empty model for split_model, a transformers model given by module names, a
model on the meta device for the Pipeline, a GraphTrainer optimizer that
holds none of the model's parameters. One process."""


import pytest
import torch

import hyperparallel as hp
from hyperparallel.compile import GraphTrainer, PassConfig


class Generic(torch.nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.tok = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(n)])
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.tok(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def tiny_llama(layers):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


def test_split_model_refuses_a_compiled_model_naming_the_way():
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(TypeError, match=r"torch.compile\(model\): cut the model itself"):
        hp.pipeline.split_model(torch.compile(Generic()), sched, 0, embed=["tok"],
                                blocks="blocks", tail=["head"])
    with pytest.raises(TypeError, match=r"torch.compile\(model\)"):
        hp.pipeline.split_model(torch.compile(tiny_llama(2)), sched, 0)


def test_split_model_refuses_a_model_without_layers():
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match=r"no blocks \(0 layers"):
        hp.pipeline.split_model(tiny_llama(0), sched, 0)


def test_split_model_refuses_a_transformers_model_given_by_module_names():
    sched = hp.pipeline.schedule("1f1b", ranks=2, microbatches=2)
    with pytest.raises(ValueError, match="is a transformers model: its decoder layers take more"):
        hp.pipeline.split_model(tiny_llama(2), sched, 0, embed=["model.embed_tokens"],
                                blocks="model.layers", tail=["model.norm", "lm_head"])



def test_a_pipeline_of_a_model_on_the_meta_device_is_refused(one_rank_group):
    sched = hp.pipeline.schedule("1f1b", ranks=1, microbatches=2)
    with torch.device("meta"):
        chunk = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="chunk 0's parameters are on the meta device.*to_empty"):
        hp.pipeline.Pipeline({0: chunk}, sched, loss_fn=torch.nn.functional.mse_loss,
                             activation_shape=(2, 4), group=one_rank_group)


def test_a_graph_trainer_whose_optimizer_holds_none_of_the_models_parameters_is_refused():
    model, other = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2)
    trainer = GraphTrainer(
        model, lambda m, x, y: torch.nn.functional.mse_loss(m(x), y), PassConfig(),
        optimizer_config={"optimizer": lambda params: torch.optim.SGD(other.parameters(), lr=1)},
        device="cpu")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="holds none of the model's 2 trainable parameters"):
        trainer.train_step(x, y)
