"""FP8 weights: the checkpoint formats, the numbers, the quantized linear layer and its GEMMs.

* ``formats``: which quantization a checkpoint declares (config.json's ``quantization_config``) and
  whether radixserve serves it; what ``--quantization fp8`` adds; which tensor-parallel splits cut a
  checkpoint's FP8 blocks.
* ``fp8``: quantize and dequantize (weights per output row or per block, 2-D or stacked 3-D;
  activations per token), and the scale layouts.
* ``linear``: ``Fp8Weight`` (an FP8 weight and its scales, the container the layers hold),
  ``Fp8Linear`` (a projection over it) and ``Fp8Experts`` (an MoE layer's two expert stacks);
  swapping a built model's projections and experts for them.
* ``gemm``: the matmul of an FP8 weight: ``torch.nn.functional.scaled_mm`` on GPUs with FP8 tensor
  cores, the weight dequantized per matmul elsewhere; ``choose_gemms`` is what the device profile
  (model/device.py) asks.
* ``grouped``: the FP8 experts' matmul: ``scaled_grouped_mm`` where torch's FP8 grouped GEMM runs,
  else the MoE op's torch reference dequantizing each routed expert; ``choose_experts`` is what the
  device profile asks.
* ``load``: which of a model's projections and experts are FP8 for a checkpoint (``plan``), and
  loading their weights and scales (model/loader.py hands it the tensors that are FP8's business);
  ``expert_load`` loads the experts', ``checkpoint`` holds what the two share (headers, scales in
  our layout and a rank's part of them, filling parameters once).
"""
