// Anchors the precompiled LibTorch header (hp/core/torch_pch.h) in a target
// of its own so that every LibTorch room can reuse it.
