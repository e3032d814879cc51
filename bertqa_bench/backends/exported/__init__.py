"""Backends that run an exported model: the ONNX export they share (``onnx_export``), ONNX
Runtime (``onnxruntime``, its static INT8 quantization ``ort_static``), OpenVINO (``openvino``)
and TensorRT (``tensorrt``). Each is imported only when a variant uses it."""
