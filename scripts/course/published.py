"""Published GPU results, for the cells that skip on a CPU: one home for every figure the course did not measure.

    from course.published import show
    show("zero_model_states")   # prints the result, labelled "published, not measured here", with its source

Each entry is a result as its source states it, with the citation; a number goes in only after it was checked
against that source. Add an entry here rather than writing a published figure into a notebook cell.
"""

from __future__ import annotations

from typing import NamedTuple


class Published(NamedTuple):
    result: str  # what the source reports, in one or two sentences
    source: str  # authors, title, venue, year, and where in it


PUBLISHED: dict[str, Published] = {
    "ddp_near_linear": Published(
        "evaluations show that, when configured appropriately, PyTorch's distributed data parallel module "
        "attains near-linear scalability using 256 GPUs",
        "Li et al., PyTorch Distributed: Experiences on Accelerating Data Parallel Training, VLDB 2020 "
        "(arXiv:2006.15704), abstract"),
    "nvidia_smi_topo": Published(
        "on an 8-GPU server each GPU showed NV1 or NV2 (one or two bonded NVLinks) to four of the other GPUs and "
        "SOC (PCIe plus the link between the CPU sockets) to the other three; on a 4-GPU PCIe server, PHB (through "
        "the CPU's host bridge) between the two GPUs of a socket and SOC across the sockets",
        "nvidia-smi topo -m outputs published in 'GPU topology examples', "
        "gist.github.com/ashwin/e139748bdba15f5af63f0146d01ee4c3 (2017)"),
    "nccl_debug_info": Published(
        "with NCCL_DEBUG=INFO each line starts with host:pid:thread and the device index, then 'NCCL INFO' and "
        "what NCCL chose: which network plugin it loaded and assigned to the communicator (InfiniBand in its "
        "example), which network it uses, and whether DMA-BUF is available on the GPU; with VERSION it prints "
        "only the NCCL and CUDA versions",
        "NVIDIA, NCCL User Guide, Troubleshooting: Logging, 'Example Output' "
        "(docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/logging.html)"),
    "megatron_tp_weak_scaling": Published(
        "Megatron-LM v1.0 split GPT-2 models of 1.2, 2.0, 4.2 and 8.7 billion parameters over 1, 2, 4 and 8 GPUs "
        "of one DGX-2H server with its intra-layer (tensor) model parallelism, batch size 8: iteration times of "
        "1288, 1242, 1357 and 1508 ms, that is 90.7 %, 86.5 % and 79.6 % of linear weak scaling on 2, 4 and 8 GPUs",
        "NVIDIA ADLR, MegatronLM's Supercharged V1.0, nv-adlr.github.io/MegatronLMV1, Table 1 (weak model "
        "parallel scaling)"),
    "zero_model_states": Published(
        "a GPT-2-like model of 1.5 billion parameters trained with Adam in mixed precision needs at least 24 GB "
        "for its model states alone (16 bytes per parameter); with sequence length 1K and batch size 32 its "
        "activations need about 60 GB more, about 8 GB with activation checkpointing",
        "Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion Parameter Models, SC 2020 "
        "(arXiv:1910.02054), section 3"),
    "gpipe_bubble": Published(
        "GPipe's authors found the bubble overhead negligible in their experiments once the number of "
        "micro-batches M is at least 4 times the number of pipeline stages K (M >= 4 x K)",
        "Huang et al., GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism, NeurIPS 2019 "
        "(arXiv:1811.06965), section 2.3"),
    "interleaved_1f1b": Published(
        "the interleaved pipeline schedule (several smaller stages per GPU) improves throughput by 10+% with a "
        "memory footprint comparable to existing schedules, on GPU clusters training GPT models",
        "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
        "SC 2021 (arXiv:2104.04473), abstract"),
    "zero_bubble": Published(
        "splitting the backward into input-gradient and weight-gradient passes and scheduling the weight "
        "gradients into the bubble outperforms the 1F1B schedule by up to 23% in throughput under a similar memory "
        "limit, and by up to 31% when the memory constraint is relaxed",
        "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024 (arXiv:2401.10241), abstract"),
    "megatron_3d": Published(
        "composing tensor, pipeline and data parallelism, training iterations on a model with 1 trillion "
        "parameters ran at 502 petaFLOP/s on 3072 GPUs, a per-GPU throughput of 52% of theoretical peak",
        "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
        "SC 2021 (arXiv:2104.04473), abstract"),
    "torchtitan_composed": Published(
        "stacking training optimizations on NVIDIA H100 GPUs gave accelerations of 65.08% with 1D parallelism at "
        "the 128-GPU scale (Llama 3.1 8B), an additional 12.59% with 2D parallelism at the 256-GPU scale (Llama "
        "3.1 70B), and an additional 30% with 3D parallelism at the 512-GPU scale (Llama 3.1 405B), over "
        "optimized baselines",
        "Liang et al., TorchTitan: One-stop PyTorch native solution for production ready LLM pre-training, "
        "arXiv:2410.06511 (2024), abstract"),
}


def show(key: str) -> None:
    """Print one published result, labelled as such, with its source."""
    entry = PUBLISHED[key]
    print(f"published, not measured here: {entry.result} ({entry.source})")
