"""The GPU's SM clock, power and clock-limit reasons through NVML (the `pynvml` module of the
nvidia-ml-py package), sampled beside a measurement.

Where pynvml is missing or finds no GPU (CPU runs, CI) nothing is sampled: gpu_state() and
PowerSampler.note say "not sampled: <why>", and the run goes on without clock figures.
"""
import statistics
import threading
import time

INTERVAL_MS = 100  # the driver refreshes clock and power readings about every 100 ms
NOT_SAMPLED = "not sampled"


def _nvml_handle(device_index, nvml=None):
    """(pynvml, handle) for the CUDA device of this index (CUDA_VISIBLE_DEVICES mapped to NVML's
    numbering as torch.cuda does); raises with the reason when NVML cannot be used."""
    if nvml is None:
        import pynvml as nvml
    nvml.nvmlInit()
    index = device_index
    try:
        import torch
        index = torch.cuda._get_nvml_device_index(device_index)
    except Exception:  # noqa: BLE001  (no torch helper: CUDA_VISIBLE_DEVICES is taken as unset)
        pass
    return nvml, nvml.nvmlDeviceGetHandleByIndex(index)


def _reasons(nvml, handle):
    get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return f"0x{get(handle):x}"


def _why(exc):
    if isinstance(exc, ImportError):
        return f"{NOT_SAMPLED}: no pynvml (the nvidia-ml-py package)"
    return f"{NOT_SAMPLED}: {type(exc).__name__}: {exc}".strip()[:200]


def gpu_state(device_index=0, nvml=None):
    """Driver, clocks, power limit, temperature and performance state of the GPU now, or
    {"nvml": "not sampled: ..."}."""
    try:
        nvml, h = _nvml_handle(device_index, nvml)
        driver = nvml.nvmlSystemGetDriverVersion()
        return {"driver": driver.decode() if isinstance(driver, bytes) else driver,
                "clock_sm_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                "clock_max_sm_mhz": nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM),
                "clock_mem_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
                "power_limit_w": nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
                "temp_c": nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
                "pstate": f"P{nvml.nvmlDeviceGetPerformanceState(h)}",
                "clock_limit_reasons": _reasons(nvml, h)}
    except Exception as exc:  # noqa: BLE001  (ImportError, NVMLError: no driver, no GPU)
        return {"nvml": _why(exc)}


class PowerSampler:
    """A background thread reading the SM clock (MHz), power (W) and clock-limit reasons (bit 0x4:
    the software power cap) every interval_ms between start() and stop(); stop() returns the
    samples [{"t": time.time(), "sm_mhz", "power_w", "reasons"}]. Without NVML, start() starts
    nothing, `note` says why and stop() returns []."""

    def __init__(self, device_index=0, interval_ms=INTERVAL_MS, nvml=None):
        self.device_index, self.interval_ms, self._nvml = device_index, interval_ms, nvml
        self.note = None
        self.samples = []
        self._stop = threading.Event()
        self._thread = None

    @property
    def running(self):
        return self._thread is not None

    def start(self):
        try:
            nvml, h = _nvml_handle(self.device_index, self._nvml)
            self._read(nvml, h)  # fails here, not in the thread, when a query is not supported
        except Exception as exc:  # noqa: BLE001
            self.note = _why(exc)
            return self
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(nvml, h), daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _read(nvml, h):
        return {"t": time.time(), "sm_mhz": nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
                "power_w": nvml.nvmlDeviceGetPowerUsage(h) / 1000, "reasons": _reasons(nvml, h)}

    def _loop(self, nvml, h):
        while not self._stop.is_set():
            try:
                self.samples.append(self._read(nvml, h))
            except Exception as exc:  # noqa: BLE001
                self.note = _why(exc)
                return
            self._stop.wait(self.interval_ms / 1e3)

    def stop(self):
        """Ends the sampling thread; safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)
        return self.samples


def clocks_in_windows(samples, windows):
    """Per key of windows ({key: [(start, end) epoch seconds]}): the median SM clock and power of
    the samples inside one of its spans, their count and the clock-limit reasons seen there. Keys
    without a sample inside their spans are left out, and so are samples outside every span."""
    res = {}
    for key, spans in windows.items():
        inside = [s for s in samples if any(a <= s["t"] <= b for a, b in spans)]
        if not inside:
            continue
        c = {"samples": len(inside)}
        for field in ("sm_mhz", "power_w"):
            vals = [s[field] for s in inside if s.get(field) is not None]
            if vals:
                c[field] = statistics.median(vals)
        reasons = sorted({s["reasons"] for s in inside if s.get("reasons")})
        if reasons:
            c["clock_limit_reasons"] = reasons
        res[key] = c
    return res


def record_clocks(rec, variant_records, sampler, windows):
    """A stopped sampler's samples into an item: rec["clock_sampling"] says how it was sampled (or
    "not sampled: ..."), and each variant of variant_records ({key: record}) with samples inside
    its blocks gets "clocks"."""
    if sampler.note and not sampler.samples:
        rec["clock_sampling"] = sampler.note
        return
    rec["clock_sampling"] = {"tool": "nvml", "interval_ms": sampler.interval_ms, "samples": len(sampler.samples)}
    for key, clocks in clocks_in_windows(sampler.samples, windows).items():
        if key in variant_records:
            variant_records[key]["clocks"] = clocks
