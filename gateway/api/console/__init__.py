"""The incident console, /admin/ui: server-rendered pages over the admin API, behind the admin token."""

from gateway.api.console.pages import ConsoleRoutes

__all__ = ["ConsoleRoutes"]
