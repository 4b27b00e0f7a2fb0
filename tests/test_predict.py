"""The GPU step-time prediction (scripts/benchmarking/predict.py): the roofline
arithmetic by hand, and a prediction read from the compiled program (a larger
batch gives proportionally more FLOPs and a longer predicted step)."""
import helpers  # noqa: F401  (scripts/ and configs/ on sys.path)
import pytest

from benchmarking.predict import H200, predict, roofline


def test_roofline_takes_the_larger_of_compute_and_memory_time():
    r = roofline(989e12, 4.8e12 / 2, 989.0, 4.8)  # 1 s of compute, 0.5 s of memory
    assert r == {"compute_s": 1.0, "memory_s": 0.5, "predicted_step_s": 1.0, "bound": "compute"}
    r = roofline(989e9, 4.8e12, 989.0, 4.8)
    assert r["bound"] == "memory" and r["predicted_step_s"] == pytest.approx(1.0)
    assert r["compute_s"] == pytest.approx(1e-3)


def test_the_prediction_comes_from_the_compiled_step_and_scales_with_the_batch():
    small = predict("resnet8", (8, 8, 1), 10, 8, precision="fp32")
    large = predict("resnet8", (8, 8, 1), 10, 32, precision="fp32")
    # the convolutions' FLOPs are linear in the batch (the optimizer's are not)
    assert 3.5 < large["flops"] / small["flops"] <= 4.0
    assert large["bytes_accessed"] > small["bytes_accessed"] > 0
    for p in (small, large):
        assert p["device"] == H200["name"] and p["batch"] in (8, 32)
        assert p["predicted_step_s"] == max(p["flops"] / 989e12, p["bytes_accessed"] / 4.8e12)
        assert p["predicted_images_per_s"] == pytest.approx(p["batch"] / p["predicted_step_s"])
    assert large["predicted_step_s"] > small["predicted_step_s"]
