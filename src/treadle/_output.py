"""Structured output: the shape a run's final answer must have (docs/structured-output.md).

An agent's ``output_type`` (an attrs class or a JSON schema) is resolved once, when the
`treadle.Agent` is built, into an `OutputSpec`: how the model is asked for the output
(``native``: the provider's structured output on the request; ``tool``: a declared
final-answer tool whose arguments are the output), the JSON schema, and the validator.

`OutputSpec.decide` turns a parser's decision into the run's decision: a final answer (or a
call of the final-answer tool) whose output fits becomes a final answer carrying the output as
JSON data; one that does not fit becomes an invalid decision whose feedback lists every error
(docs/decisions/0040-structured-output.md). It is pure, so a resumed run decides the same
from the stored reply.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs
import cattrs

from treadle._exceptions import UsageError
from treadle._repair import json_values, strip_code_fence
from treadle._schema import (
    _CONVERTER,
    Parameter,
    _kind,
    argument_validator,
    build_schema,
    check_default,
    check_type,
    summary_of,
    unstructure_text,
    validation_errors,
)
from treadle.parsers import (
    MAX_ARGUMENT_DEPTH,
    NESTED_TOO_DEEP,
    TOOL_CALL_FROM_CONTENT,
    _read_from_text,
    _text_answer,
    argument_problem,
)
from treadle.types import (
    DecisionKind,
    JSONValue,
    ModelReply,
    OutputFormat,
    ParsedReply,
    ToolSpec,
)

OUTPUT_TOOL: Final = "final_answer"
"""The name of the final-answer tool declared in ``tool`` mode."""

INVALID_OUTPUT: Final = "invalid_output"
"""`ParsedReply.reason` of a final answer that does not fit the output schema."""

OutputMode: TypeAlias = Literal["auto", "native", "tool"]
"""How the output is asked for: ``native`` (the provider's structured output), ``tool`` (a
final-answer tool), or ``auto`` (``native`` when the model client declares
``native_output = True``, else ``tool``)."""

_NAME: Final = re.compile(r"[^A-Za-z0-9_-]")
_MAX_ERRORS: Final = 10
_PLAIN: Final = cattrs.Converter()
_PLAIN.register_unstructure_hook(str, unstructure_text)  # a str enum's member is its value
_TOOL_DESCRIPTION: Final = (
    "Give your final answer. Call this alone, once the task is done: its arguments are the "
    "answer, and the conversation ends with it."
)


@attrs.frozen(kw_only=True, eq=False)
class OutputSpec:
    """An agent's resolved output type.

    Attributes:
        mode: ``native`` or ``tool`` (never ``auto``: that is resolved against the client).
        name: the final-answer tool's name (``tool``), or the schema's name (``native``).
        schema: the JSON schema of the output; its top level is an object.
        strict: whether the schema is in the subset OpenAI's ``strict`` mode accepts (every
            object closed with ``additionalProperties: false``, every property required).
        description: the attrs class's docstring summary, or the schema's ``description``.
        output_type: the attrs class, or ``None`` for a JSON schema.
    """

    mode: str
    name: str
    schema: Mapping[str, JSONValue]
    strict: bool
    description: str = ""
    output_type: type[Any] | None = None

    def snapshot(self) -> dict[str, JSONValue]:
        """The model-visible part, for the parameter snapshot's ``output`` key."""
        return {
            "mode": self.mode,
            "name": self.name,
            "schema": dict(self.schema),
            "strict": self.strict,
            "description": self.description,
        }

    def tool_spec(self) -> ToolSpec | None:
        """The final-answer tool declared to the model in ``tool`` mode, else ``None``."""
        if self.mode != "tool":
            return None
        description = _TOOL_DESCRIPTION
        if self.description:
            description += f" The answer: {self.description}"
        return ToolSpec(name=self.name, description=description, parameters=dict(self.schema))

    def request_format(self) -> OutputFormat | None:
        """The native structured output put on every request in ``native`` mode, else ``None``."""
        if self.mode != "native":
            return None
        return OutputFormat(
            name=self.name,
            schema=dict(self.schema),
            strict=self.strict,
            description=self.description,
        )

    def validate(self, value: Any) -> JSONValue | tuple[str, ...]:
        """Check decoded JSON ``value`` against the output type.

        Returns:
            The output as JSON data (for an attrs class: its unstructured instance, with
            defaults filled in), or every error as ``"<problem> @ $.path"``.
        """
        unstorable = _unstorable(value)
        if unstorable is not None:
            return (unstorable,)
        if self.output_type is not None:
            return _validate_class(self.output_type, value)
        return _validate_schema(self.schema, value)

    def decide(self, parsed: ParsedReply, reply: ModelReply) -> tuple[ParsedReply, JSONValue]:
        """The run's decision on ``reply`` and its output (``None`` without one).

        ``parsed`` is the parser's decision on ``reply``.

        * a call the parser made out of a text reply (`treadle.parsers.NativeToolCallParser`
          rules 4 and 5: a call written in the content, the text-reply tool) when the text is
          the answer: in ``native`` mode always (it is checked as a final answer), in
          ``tool`` mode when it is one JSON object fitting the output (a final answer) and,
          for a call written in the content, the output refuses some object
          (`_tells_answers`). A structured answer ``{"name": ..., "arguments": ...}`` of an
          output that requires those keys is never run as a call (docs/structured-output.md,
          "Native or a final-answer tool").
        * ``tool`` mode, a call of the final-answer tool: alone and fitting, a final answer
          with its arguments as output; alone and not fitting, or with other calls, an
          invalid decision (no call of the reply runs).
        * a final answer (either mode): its text, one JSON object (optionally in one
          ```` ```json ```` fence), fitting, is the output; anything else is an invalid
          decision whose feedback lists the errors. A refusal is left as it is.
        * other decisions are returned unchanged.
        """
        if _read_from_text(parsed):
            answered = self._answer(_text_answer(reply))
            if self.mode == "native" or (
                answered[0].kind is DecisionKind.FINAL_ANSWER and self._tells_answers(parsed)
            ):
                return answered
        if parsed.kind is DecisionKind.ACTIONS and self.mode == "tool":
            answers = [call for call in parsed.actions if call.name == self.name]
            if not answers:
                return parsed, None
            if len(parsed.actions) > 1:
                return self._invalid(
                    parsed,
                    f"The {self.name} tool must be called alone, after the results of the "
                    f"other tools came back. None of the {len(parsed.actions)} tool calls of "
                    "this reply was executed.",
                ), None
            return self._checked(parsed, answers[0].arguments)
        if parsed.kind is not DecisionKind.FINAL_ANSWER or parsed.reason == "refusal":
            return parsed, None
        return self._answer(parsed)

    def _tells_answers(self, parsed: ParsedReply) -> bool:
        """Whether a fitting text ``parsed`` read as a call is an answer (``tool`` mode).

        The text-reply tool's call is; a call written in the content is only when the output
        refuses some object (``{}`` does not fit): a schema any object fits (no required
        property) says nothing of which texts are answers, and the call stands.
        """
        if TOOL_CALL_FROM_CONTENT not in parsed.repairs:
            return True
        return isinstance(self.validate({}), tuple)

    def _answer(self, parsed: ParsedReply) -> tuple[ParsedReply, JSONValue]:
        """The decision on the final answer ``parsed``: its text, one JSON object, checked."""
        text = (parsed.text or "").strip()
        inner = strip_code_fence(text)
        found = json_values(text if inner is None else inner.strip())
        if found.error is not None or len(found.values) != 1:
            why = found.error or f"{len(found.values)} JSON values instead of one"
            feedback = f"Your answer is not one JSON object ({why}). {self._ask}"
            return self._invalid(parsed, feedback), None
        return self._checked(parsed, found.values[0])

    @property
    def _ask(self) -> str:
        if self.mode == "tool":
            return f"Give the final answer by calling the {self.name} tool."
        return "Answer with one JSON object that fits the schema."

    def _checked(self, parsed: ParsedReply, value: Any) -> tuple[ParsedReply, JSONValue]:
        checked = self.validate(value)
        if isinstance(checked, tuple):
            shown = "; ".join(checked[:_MAX_ERRORS])
            more = f" (and {len(checked) - _MAX_ERRORS} more)" if len(checked) > _MAX_ERRORS else ""
            message = f"Your answer does not fit the output schema: {shown}{more}. {self._ask}"
            return self._invalid(parsed, message), None
        decided = ParsedReply(
            kind=DecisionKind.FINAL_ANSWER,
            text=parsed.text,
            repairs=parsed.repairs,
            history_message=parsed.history_message,
        )
        return decided, checked

    @staticmethod
    def _invalid(parsed: ParsedReply, feedback: str) -> ParsedReply:
        return ParsedReply(
            kind=DecisionKind.INVALID,
            text=parsed.text,
            feedback=feedback,
            reason=INVALID_OUTPUT,
            repairs=parsed.repairs,
            history_message=parsed.history_message,
        )


def resolve(
    output_type: Any,
    mode: str,
    *,
    native_client: bool | None,
    tool_names: frozenset[str],
    text_reply_tool: str | None = None,
) -> OutputSpec:
    """Resolve an agent's ``output_type`` and ``output_mode``.

    Args:
        output_type: an attrs class, or a JSON schema (a mapping) whose top level is an
            object.
        mode: ``auto``, ``native`` or ``tool``.
        native_client: the model client's ``native_output`` (``None`` when it declares
            none).
        tool_names: the executor's tool names.
        text_reply_tool: the parser's ``text_reply_tool`` (``None`` when it has none).

    Raises:
        UsageError: an unknown mode; ``native`` with a client declaring
            ``native_output = False``, or (resolved) with a parser whose text replies call a
            tool (docs/decisions/0108-no-text-reply-tool-with-native-output.md); a type that
            is neither an attrs class nor a mapping, a field type that is not JSON-shaped, a
            schema that is not valid JSON Schema or whose top level is not an object, a
            ``$ref`` naming nothing inside the schema, references looping without descending
            into the value; or a tool of the executor named like the final-answer tool in
            ``tool`` mode (docs/structured-output.md, "Output types").
    """
    if mode not in ("auto", "native", "tool"):
        raise UsageError(f"output_mode must be 'auto', 'native' or 'tool', got {mode!r}")
    if mode == "native" and native_client is False:
        raise UsageError(
            "output_mode='native' needs a model client with native structured output; this "
            "one has none (native_output = False): use output_mode='tool'"
        )
    resolved = mode if mode != "auto" else ("native" if native_client else "tool")
    if isinstance(output_type, type) and attrs.has(output_type):
        schema, description = _class_schema(output_type)
        name = _NAME.sub("_", output_type.__name__)[:64] or "output"
        cls: type[Any] | None = output_type
    elif isinstance(output_type, Mapping):
        schema = _checked_schema(output_type)
        description = str(schema.get("description") or "")
        name = "output"
        cls = None
    else:
        raise UsageError(
            f"output_type must be an attrs class or a JSON schema (a mapping), got {output_type!r}"
        )
    if resolved == "native" and text_reply_tool is not None:
        raise UsageError(
            f"native output takes the text of a reply as the final answer, and this parser "
            f"makes every text reply a call of {text_reply_tool!r} (text_reply_tool): no "
            "answer could ever be given. Use output_mode='tool' (the answer is then a call of "
            f"{OUTPUT_TOOL!r}), or a parser without text_reply_tool"
        )
    if resolved == "tool":
        if OUTPUT_TOOL in tool_names:
            raise UsageError(
                f"the executor declares a tool named {OUTPUT_TOOL!r}, the name of the "
                "final-answer tool: rename it, or use output_mode='native'"
            )
        name = OUTPUT_TOOL
    return OutputSpec(
        mode=resolved,
        name=name,
        schema=schema,
        strict=is_strict(schema),
        description=description,
        output_type=cls,
    )


def _class_schema(cls: type[Any]) -> tuple[dict[str, Any], str]:
    """The JSON schema of an attrs class (as tool arguments get theirs), and its summary.

    A field with ``init=False`` is computed by the class, so it is not asked of the model
    (docs/structured-output.md, "Output types").

    Raises:
        UsageError: a field type that is not JSON-shaped, a default that holds NaN or an
            infinity (`treadle._schema.check_default`), or an ``init=False`` field with no
            default in a class without ``__attrs_post_init__`` (nothing would set it).
    """
    where = f"output_type {cls.__qualname__}"
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError) as exc:
        raise UsageError(f"{where}: cannot resolve the field types: {exc}") from exc
    docs = _attribute_docs(cls.__doc__)
    parameters = []
    for field in attrs.fields(cls):
        if not field.init:
            _check_computed(cls, field, where)
            continue
        annotation = hints.get(field.name, field.type)
        check_type(annotation, f"{where}, field {field.name!r}")
        default: Any = inspect.Parameter.empty
        if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            if field.default.takes_self:
                raise UsageError(f"{where}, field {field.name!r}: a default taking self")
            default = field.default.factory()
        elif field.default is not attrs.NOTHING:
            default = field.default
        if default is not inspect.Parameter.empty:
            check_default(default, f"{where}, field {field.name!r}")
        parameters.append(
            Parameter(
                name=field.name,
                annotation=annotation,
                default=default,
                description=docs.get(field.name),
            )
        )
    schema = build_schema(_NAME.sub("_", cls.__name__), tuple(parameters))
    return schema, summary_of(cls.__doc__)


def _check_computed(cls: type[Any], field: Any, where: str) -> None:
    """Refuse an ``init=False`` field of ``cls`` that nothing sets.

    With no default and no ``__attrs_post_init__`` (or ``__attrs_pre_init__``), an
    instance made from an answer has no value for it: `treadle.RunResult.output` would
    hold attrs' ``NOTHING`` there.
    """
    hooks = ("__attrs_post_init__", "__attrs_pre_init__")
    if field.default is attrs.NOTHING and not any(hasattr(cls, hook) for hook in hooks):
        raise UsageError(
            f"{where}, field {field.name!r} is init=False with no default, and the class has "
            "no __attrs_post_init__ to compute it: give it a default, or compute it there"
        )


def _attribute_docs(doc: str | None) -> dict[str, str]:
    """Field name -> description from the docstring's Google ``Attributes:`` section."""
    import docstring_parser  # loaded with the first output type, as for tools

    parsed = docstring_parser.parse(doc or "", style=docstring_parser.DocstringStyle.GOOGLE)
    return {
        p.arg_name: " ".join((p.description or "").split())
        for p in parsed.params
        if p.args and p.args[0] == "attribute"
    }


def _checked_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    r"""The output JSON ``schema`` as plain JSON data, checked.

    It is checked against the 2020-12 meta-schema by the validator answers meet
    (`treadle._schema.argument_validator`), which does not compile patterns with Python's
    `re`: JSON Schema's are ECMA-262 ones, and a valid schema with a named group
    (``(?<major>\d+)``) was refused as "not a 'regex'" (docs/structured-output.md,
    "Output types").

    Raises:
        UsageError: the schema is not JSON data, not a valid JSON schema, nests too deeply,
            has a reference `_check_references` refuses, or its top level is no object.
    """
    import jsonschema  # loaded with the first output schema

    try:
        plain = json.loads(json.dumps(schema, allow_nan=False))
        argument_validator(plain, draft=jsonschema.Draft202012Validator)
        _check_references(plain)
    except RecursionError:  # its answers could not be stored either (MAX_ARGUMENT_DEPTH)
        raise UsageError("output_type: the schema nests too deeply to be checked") from None
    except jsonschema.SchemaError as exc:
        raise UsageError(f"output_type: not a valid JSON schema: {exc.message}") from exc
    except UsageError:
        raise
    except (TypeError, ValueError) as exc:
        raise UsageError(f"output_type: the schema is not JSON data: {exc}") from exc
    if plain.get("type") != "object":
        raise UsageError(
            'output_type: the schema\'s top level must be {"type": "object", ...} (providers '
            "accept no other), got type " + repr(plain.get("type"))
        )
    return dict(plain)


def _check_references(schema: dict[str, Any]) -> None:
    """Refuse a schema with a ``$ref`` (or ``$dynamicRef``) that names no schema inside it.

    `check_schema` passes ``{"$ref": "#/$defs/Missing"}``, and ``{"$ref": "#/required"}``
    (a list); validating an answer against either then raised inside the run, interrupting
    it at every resume. A reference is looked up as the validator would, from the base URI
    of the subschema holding it (``$id``); a reference outside the schema (a URL) is refused
    too: nothing is fetched. Then the references are followed for a loop (`_check_loops`)
    and for chains too long to validate (`_check_depth`).

    Raises:
        UsageError: names the reference that does not resolve or points at no schema (a
            list, a number, a string, null: `_check_target`), the loop, or the chain.
    """
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    checked: set[int] = set()

    def walk(resolver: Any, resource: Any) -> None:
        contents = resource.contents
        if isinstance(contents, dict):
            for keyword in ("$ref", "$dynamicRef"):
                reference = contents.get(keyword)
                if isinstance(reference, str):
                    _check_target(keyword, reference, resolver, checked)
        for sub in resource.subresources():
            walk(resolver.in_subresource(sub), sub)

    root = DRAFT202012.create_resource(schema)
    resolver = Registry().resolver_with_root(root)
    walk(resolver, root)
    _check_loops(schema, resolver)
    _check_depth(schema, resolver)


def _check_target(keyword: str, reference: str, resolver: Any, checked: set[int]) -> None:
    """Refuse a reference that resolves to nothing, or to a value that is no valid schema.

    A schema is an object or ``true``/``false`` (JSON Schema 2020-12, "Schema documents");
    a reference resolved by pointer into something else (``#/required``, ``#/type``, a
    ``maximum``, an object inside an ``enum``) is no schema the validator can apply
    (docs/structured-output.md, "Output types"). Each target is checked once: ``checked``
    holds the ids of those seen.

    Raises:
        UsageError: names the keyword, the reference and what it names.
    """
    import jsonschema
    from referencing.exceptions import Unresolvable

    try:
        target = resolver.lookup(reference).contents
    except Unresolvable as exc:
        raise UsageError(
            f"output_type: {keyword} {reference!r} names nothing in the schema ({exc}); a "
            "reference must point inside it"
        ) from None
    if id(target) in checked:
        return
    checked.add(id(target))
    problem = None if isinstance(target, dict | bool) else "which is no schema"
    if isinstance(target, dict):
        try:
            argument_validator(target, draft=jsonschema.Draft202012Validator)
        except jsonschema.SchemaError as exc:
            problem = f"which is no valid schema ({exc.message})"
    if problem is not None:
        shown = json.dumps(target)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UsageError(
            f"output_type: {keyword} {reference!r} names {shown}, {problem}; a reference "
            "must point at a schema (an object, true or false)"
        )


_IN_PLACE: Final = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")
"""Keywords whose subschemas apply to the very value their schema applies to (with ``$ref``
and ``$dynamicRef``); the others (``properties``, ``items`` …) apply to a part of it."""


def _check_loops(schema: dict[str, Any], resolver: Any) -> None:
    """Refuse references that lead back to a schema without descending into the value.

    ``{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}`` passes
    `check_schema` and resolves, but validating any value against ``a`` applies ``b`` to
    the same value, then ``a`` again, without end (RecursionError inside the run, at every
    resume). A recursive schema whose loop passes through ``properties``, ``items`` or
    another keyword applying to a part of the value is accepted: each turn goes one level
    deeper into a finite value.

    Raises:
        UsageError: names the loop, as JSON pointers into the schema.
    """
    done: set[int] = set()
    for node, scope in _subschemas(schema, resolver):
        loop = _loop_from(node, scope, done)
        if loop is not None:
            names = _pointers(schema)
            shown = " → ".join(names.get(id(part), "?") for part in loop)
            raise UsageError(
                f"output_type: the schema's references loop without descending into the "
                f"value ({shown}): validating an answer would never end; a recursive "
                "reference must pass through properties, items or another keyword that "
                "applies to a part of the value"
            )


_Edges: TypeAlias = dict[int, tuple[Any, list[int], list[int]]]
"""Schemas by id: each schema, its `_in_place` children's ids, its `_descending` ones'."""

_MAX_APPLIED: Final = 300
"""The most schemas validating an answer may apply one within another. jsonschema takes two
Python frames for each (``not``: three): measured, a chain of 489 references validates in a
bare trio run and 390 with 200 frames of callers above it, so 300 (600 frames) keeps it
inside the default recursion limit of 1000 with room for the run's own frames, and admits
the usual recursive JSON-value schema (257 at the 64 levels an answer may nest)."""

_DESCENDING: Final = (
    "properties",
    "patternProperties",
    "additionalProperties",
    "items",
    "prefixItems",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
"""Keywords whose subschemas apply to a part of the value (one level deeper)."""


def _check_depth(schema: dict[str, Any], resolver: Any) -> None:
    """Refuse a schema whose validation of some answer would exhaust Python's stack.

    Validating applies schemas one within another: along `_in_place` steps to the same
    value, and along `_DESCENDING` keywords one level into it. ``{"$ref": "#/$defs/d0"}``
    with ``d0`` → ``d1`` → … → ``d600`` passes `_check_loops` (no loop), but every answer
    raised RecursionError inside the run, at every resume. Counted here: the most schemas
    applied one within another for any answer `OutputSpec.validate` lets through (nested at
    most `treadle.parsers.MAX_ARGUMENT_DEPTH` levels); more than `_MAX_APPLIED` is refused.
    Runs after `_check_loops`: the `_in_place` steps form no loop.

    Raises:
        UsageError: names the longest chain of references applied to one value, and the
            count.
    """
    edges = _application_edges(schema, resolver)
    applied, alone = _applied(edges)
    if applied[id(schema)] <= _MAX_APPLIED:
        return
    chain = _longest_chain(edges, alone)
    names = _pointers(schema)
    first, last = names.get(id(chain[0]), "?"), names.get(id(chain[-1]), "?")
    shown = f"{first} → … → {last}" if len(chain) > 2 else " → ".join((first, last))
    raise UsageError(
        f"output_type: validating an answer could apply {applied[id(schema)]} schemas one "
        f"within another (at most {_MAX_APPLIED}: the validator could run out of stack); the "
        f"longest chain of references applied to one value is {shown} ({len(chain)} "
        f"schemas), and an answer may nest {MAX_ARGUMENT_DEPTH} levels deep"
    )


def _application_edges(schema: dict[str, Any], resolver: Any) -> _Edges:
    """Every schema validating an answer can reach from ``schema``.

    By id: the schema, the ids of those applied to the same value (`_in_place`), and the
    ids of those applied to a part of it (`_descending`).
    """
    edges: _Edges = {}
    pending = [(schema, resolver)]
    while pending:
        node, scope = pending.pop()
        if id(node) in edges:
            continue
        in_place, descending = _in_place(node, scope), _descending(node, scope)
        edges[id(node)] = (node, [id(c) for c, _ in in_place], [id(c) for c, _ in descending])
        pending.extend(in_place)
        pending.extend(descending)
    return edges


def _applied(edges: _Edges) -> tuple[dict[int, int], dict[int, int]]:
    """The most schemas applied one within another from each schema of ``edges``, by id.

    Returns:
        For a value at level 1 (the answer itself: it may hold containers down to level
        `treadle.parsers.MAX_ARGUMENT_DEPTH`, and scalars one level below), and for a
        scalar (along `_in_place` steps alone).
    """
    order = _children_first(edges)
    below: dict[int, int] = {}
    alone: dict[int, int] = {}
    for level in range(MAX_ARGUMENT_DEPTH + 1, 0, -1):
        here: dict[int, int] = {}
        for key in order:  # children first: their counts at this level are known
            in_place, descending = edges[key][1:]
            deepest = max((here[child] for child in in_place), default=0)
            if level <= MAX_ARGUMENT_DEPTH:
                deepest = max([deepest, *(below[child] for child in descending)])
            here[key] = deepest + 1
        alone = alone or here
        below = here
    return below, alone


def _children_first(edges: _Edges) -> list[int]:
    """The ids of ``edges`` ordered so that each comes after its `_in_place` children."""
    order: list[int] = []
    placed: set[int] = set()
    for start in edges:
        stack = [(start, iter(edges[start][1]))]
        while stack:
            key, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                if key not in placed:
                    placed.add(key)
                    order.append(key)
            elif child not in placed:
                stack.append((child, iter(edges[child][1])))
    return order


def _longest_chain(edges: _Edges, alone: dict[int, int]) -> list[Any]:
    """The longest chain of `_in_place` steps, as its schemas (``alone``: each one's length)."""
    key = max(alone, key=lambda k: alone[k])
    chain = [edges[key][0]]
    while edges[key][1]:
        key = max(edges[key][1], key=lambda k: alone[k])
        chain.append(edges[key][0])
    return chain


def _descending(node: Any, scope: Any) -> list[tuple[Any, Any]]:
    """The subschemas (objects, with their scopes) applied to a part of ``node``'s value."""
    from referencing.jsonschema import DRAFT202012

    if not isinstance(node, dict):
        return []
    children: list[Any] = []
    for keyword in _DESCENDING:
        value = node.get(keyword)
        if keyword in ("properties", "patternProperties") and isinstance(value, dict):
            children.extend(value.values())
        else:
            children.extend(value if isinstance(value, list) else [value])
    return [
        (child, scope.in_subresource(DRAFT202012.create_resource(child)))
        for child in children
        if isinstance(child, dict)
    ]


def _subschemas(schema: dict[str, Any], resolver: Any) -> list[tuple[Any, Any]]:
    """Every subschema of ``schema`` (``$defs`` included) with the resolver of its scope.

    In document order: a parent before its children.
    """
    from referencing.jsonschema import DRAFT202012

    found = []
    pending = [(DRAFT202012.create_resource(schema), resolver)]
    while pending:
        resource, scope = pending.pop()
        found.append((resource.contents, scope))
        children = [(sub, scope.in_subresource(sub)) for sub in resource.subresources()]
        pending.extend(reversed(children))
    return found


def _in_place(node: Any, scope: Any) -> list[tuple[Any, Any]]:
    """The subschemas (objects, with their scopes) applied to the same value as ``node``."""
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    if not isinstance(node, dict):
        return []
    found = []
    for keyword in ("$ref", "$dynamicRef"):
        try:
            target = scope.lookup(node[keyword]) if isinstance(node.get(keyword), str) else None
        except Unresolvable:  # only where no schema is (`_check_references` saw the others)
            target = None
        if target is not None:
            found.append((target.contents, target.resolver))
    for keyword in _IN_PLACE:
        value = node.get(keyword)
        if keyword == "dependentSchemas" and isinstance(value, dict):
            children = list(value.values())
        else:
            children = value if isinstance(value, list) else [value]
        found.extend(
            (child, scope.in_subresource(DRAFT202012.create_resource(child)))
            for child in children
            if isinstance(child, dict)
        )
    return found


def _loop_from(start: Any, scope: Any, done: set[int]) -> list[Any] | None:
    """A loop of `_in_place` steps reachable from ``start``, or ``None``.

    The loop is its nodes, the first repeated at the end; ``done`` holds the ids of nodes
    already known to lead to none (and gets those this search finds).
    """
    path = [start]
    branches = [iter(_in_place(start, scope))]
    while branches:
        step = next(branches[-1], None)
        if step is None:
            done.add(id(path.pop()))
            branches.pop()
            continue
        node, node_scope = step
        if any(node is seen for seen in path):
            return [*path[[id(p) for p in path].index(id(node)) :], node]
        if id(node) not in done:
            path.append(node)
            branches.append(iter(_in_place(node, node_scope)))
    return None


def _pointers(schema: Any) -> dict[int, str]:
    """The JSON pointer (``#/$defs/a``) of every object and array in ``schema``, by id."""
    names: dict[int, str] = {}
    pending: list[tuple[Any, str]] = [(schema, "#")]
    while pending:
        node, name = pending.pop()
        names[id(node)] = name
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, dict | list):
                escaped = str(key).replace("~", "~0").replace("/", "~1")
                pending.append((value, f"{name}/{escaped}"))
    return names


def is_strict(schema: Mapping[str, Any]) -> bool:
    """Whether every object of ``schema`` is closed and requires all of its properties.

    That is the subset OpenAI's ``strict: true`` accepts; a schema outside it is sent with
    ``strict: false`` (the provider then follows it as best it can, and treadle validates
    the output either way). Every subschema is looked at (as the validator finds them: a
    property named ``properties`` is a property), and each one that admits objects must
    close them (`_admits_open_objects`).
    """
    from referencing.jsonschema import DRAFT202012

    pending = [DRAFT202012.create_resource(dict(schema))]
    while pending:
        resource = pending.pop()
        if _admits_open_objects(resource.contents):
            return False
        pending.extend(resource.subresources())
    return True


_CONSTRAINING: Final = ("$ref", "$dynamicRef", "anyOf", "oneOf", "allOf", "enum", "const")
"""Keywords that, in a schema without ``type``, say what it admits (their own subschemas
are looked at in turn)."""


def _admits_open_objects(node: Any) -> bool:
    """Whether the schema ``node`` admits an object that is open or has optional properties.

    A schema admits objects when its ``type`` is ``"object"`` or a list holding it, or when
    it has no ``type`` and none of `_CONSTRAINING` (``{}`` takes any value). Closed means
    ``additionalProperties: false`` and no ``patternProperties``.
    """
    if not isinstance(node, Mapping):
        return False  # a boolean schema
    kinds = node.get("type")
    if kinds is None:
        objects = not any(keyword in node for keyword in _CONSTRAINING)
    else:
        objects = kinds == "object" or (isinstance(kinds, list) and "object" in kinds)
    if not objects:
        return False
    properties = node.get("properties", {})
    closed = node.get("additionalProperties") is False and not node.get("patternProperties")
    return not closed or set(node.get("required", ())) != set(properties)


def _validate_class(cls: type[Any], value: Any) -> JSONValue | tuple[str, ...]:
    if not isinstance(value, Mapping):
        return (f"expected a JSON object, got {_kind(value)} @ $",)
    try:
        instance = _CONVERTER.structure(dict(value), cls)
    except (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError) as exc:
        return tuple(validation_errors(exc))
    data: JSONValue = _PLAIN.unstructure(instance)
    # What is stored is read back (`structure_output`) into the instance the run returns:
    # a converter that changes a value again on that read (one that scales it, say) would
    # make the result differ from what was validated and stored.
    try:
        again = _PLAIN.unstructure(_CONVERTER.structure(data, cls))
    except (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError, ValueError) as exc:
        again = f"an error ({exc})"
    if again != data:
        return (
            f"{cls.__qualname__} does not read back as it was validated: stored as {data!r:.200}, "
            f"it reads back as {again!r:.200} (its converters must give the same value when "
            "applied again; docs/structured-output.md) @ $",
        )
    return data


def _unstorable(value: Any) -> str | None:
    """Why the decoded answer ``value`` would not read back from the log as it is, or ``None``.

    The rule of tool arguments (`treadle.parsers.argument_problem`): a number JSON cannot
    represent (``1e400`` decodes to infinity, which a record stores as ``null``) or nesting
    deeper than `treadle.parsers.MAX_ARGUMENT_DEPTH` levels (which the commands that print
    records as JSON cannot follow).
    """
    problem = argument_problem(value)
    if problem is None:
        return None
    if problem == NESTED_TOO_DEEP:
        return f"objects and arrays nest deeper than {MAX_ARGUMENT_DEPTH} levels @ $"
    return "a number JSON cannot represent (NaN or infinity, such as 1e400) @ $"


def _validate_schema(schema: Mapping[str, Any], value: Any) -> JSONValue | tuple[str, ...]:
    """Check ``value`` against the output JSON ``schema`` (as 2020-12).

    The check of every schema that is data (`treadle._schema.argument_validator`): its
    patterns (``pattern``, ``patternProperties``) are left to the provider's structured
    output. Matched with Python's `re` on the run's thread, a pattern that backtracks
    catastrophically (``^(a+)+$``) took exponential time in the length of an answer the
    model chose, freezing every run of the process past its lease, at every resume too
    (docs/structured-output.md, "Output types").

    Returns:
        ``value``, or every error as ``"<problem> @ $.path"``, ordered by path.
    """
    import jsonschema

    validator = argument_validator(schema, draft=jsonschema.Draft202012Validator)
    errors = sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        return tuple(f"{error.message} @ {_path(error.absolute_path)}" for error in errors)
    return value


def _path(parts: Any) -> str:
    """``$.a[0].b``: a JSON path in the form cattrs gives tool-argument errors."""
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def structure_output(cls: type[Any], value: JSONValue, *, run_id: str = "") -> Any:
    """Structure a stored output (JSON data) into an instance of the attrs class ``cls``.

    Raises:
        UsageError: ``value`` does not fit ``cls`` (the run was finished under another
            output type); the message lists each error with its path.
    """
    try:
        return _CONVERTER.structure(value, cls)
    except (cattrs.BaseValidationError, cattrs.ForbiddenExtraKeysError) as exc:
        errors = "; ".join(validation_errors(exc))
        run = f" of run {run_id!r}" if run_id else ""
        raise UsageError(
            f"the stored output{run} does not fit {cls.__qualname__}: {errors}"
        ) from exc
