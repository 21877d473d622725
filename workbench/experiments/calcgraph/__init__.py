"""Experiments, plots and claims of the notebook ``calcgraph`` ("CalcGraph: taming the high costs of deep
learning using models", 2022).

``workload``: the paper's MLP, a CNN and ResNet-18 by name, MNIST-shaped data;
``prediction``: memory known before execution and the CalcHeap's static size (Sections 3.2, 4.3);
``single_model``: accuracy (Fig 9), memory and time (Fig 10) of one model, heap-bound vs PyTorch;
``many_models``: many models, switching vs building anew (Fig 11);
``parallel``: models that fit in a budget at once, CalcGraph's plan vs plain PyTorch (Fig 12);
``peers``: largest batch for a budget, plan vs accelerate and Lightning (beyond the paper);
``plots``: the figures; ``claims``: the paper's claims, our targets and checks, and the ledger.
"""

from . import claims
from .many_models import explore_train_many, multi_model_times, switch_latency
from .parallel import MODES, fits_in_budget, layout_program, parallel_models, pytorch_program
from .peers import PEERS, max_batch_peers
from .plots import (
    plot_accuracy, plot_multi_model, plot_parallel, plot_peers, plot_prediction_error, plot_single_model,
)
from .prediction import METERS, PAPER_HEAP_BATCH, calcheap_layout, explain_max_batch, meter_name, prediction_error
from .single_model import FRAMEWORKS, accuracy_curves, max_accuracy_difference, single_model_cost, train_rounds
from .zoo import zoo_accuracy
from .workload import (
    DATA_SOURCES, MODELS, PAPER_MLP, load_data, model_factory, paper_mlp, paper_mlp_plan, small_cnn,
)

__all__ = [
    "zoo_accuracy",
    "claims",
    "DATA_SOURCES", "MODELS", "PAPER_MLP", "load_data", "model_factory", "paper_mlp", "paper_mlp_plan", "small_cnn",
    "METERS", "PAPER_HEAP_BATCH", "calcheap_layout", "explain_max_batch", "meter_name", "prediction_error",
    "FRAMEWORKS", "accuracy_curves", "max_accuracy_difference", "single_model_cost", "train_rounds",
    "explore_train_many", "multi_model_times", "switch_latency",
    "MODES", "fits_in_budget", "layout_program", "parallel_models", "pytorch_program",
    "PEERS", "max_batch_peers",
    "plot_accuracy", "plot_multi_model", "plot_parallel", "plot_peers", "plot_prediction_error", "plot_single_model",
]
