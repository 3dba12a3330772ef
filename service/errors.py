"""Domain errors raised below the routes; app.py maps each to its HTTP status."""


class DomainError(Exception):
    status_code = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class Invalid(DomainError):
    """A request that passed the schema but breaks a rule that needs the database."""

    status_code = 422

    def __init__(self, loc: tuple[str, str], detail: str) -> None:
        super().__init__(detail)
        self.loc = loc
