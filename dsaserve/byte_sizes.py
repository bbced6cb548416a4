"""Byte counts as people read them (1.5 GiB), for logs, errors and doctor."""


def human(n: float, unit: str = "B") -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1024
    return f"{n} {unit}"
