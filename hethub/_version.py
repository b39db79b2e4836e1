"""The package version, in a module of its own: the runtime's plan-and-version check reads it without importing the
package's lazy ``__init__`` (which would make ``hethub`` and ``hethub.runtime`` import each other)."""
__version__ = "0.1.0"
