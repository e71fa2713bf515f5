"""Errors raised by lily. Every user-facing failure is a LilyError naming the file, tensor or field."""


class LilyError(Exception):
    """Base class of every error lily raises on purpose."""


class CheckpointError(LilyError):
    """A checkpoint file, tensor or config entry is missing, malformed or inconsistent."""


class ConfigError(CheckpointError):
    """config.json is unreadable, of an unknown model type, or internally inconsistent."""


class DeviceError(LilyError):
    """The requested device is not available in this build or on this machine."""
