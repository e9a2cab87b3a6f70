"""The graders' errors: a bad spec names the field it is about, as a dotted path from the grader object.

``GraderSpecError`` is an ``InvalidArgument`` (the services' interceptor answers INVALID_ARGUMENT); ``field`` is the
path alone (``grader.graders.name.operation``) so a gateway can put it in its error's ``param``.
"""

from __future__ import annotations

from strop.common.errors import InvalidArgument


class GraderSpecError(InvalidArgument):
    """A grader spec (or its templates against a dataset) is not something strop can run."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class GradeInputError(InvalidArgument):
    """A dataset row lacks a field a template reads (``check_references`` finds these before any sampling)."""

    def __init__(self, field: str, reference: str) -> None:
        super().__init__(f"{field}: the row has no {reference!r} (the template reads {{{{ {reference} }}}})")
        self.field = field
        self.reference = reference
