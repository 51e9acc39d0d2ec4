"""``memfit data profile``: a data set's lengths in tokens
(:class:`memfit.plan.data_profile.DataProfile`)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.data.instructions import flag_problems
from memfit.data.packing import packing_figures
from memfit.errors import UsageError

app = typer.Typer(
    name="data",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def data_command() -> None:
    """Look at training data before a run: its lengths in tokens."""


@app.command("profile")
def data_profile_command(
    file: Annotated[
        str,
        typer.Argument(
            help="CSV/TSV/JSONL/JSON/Parquet file (.gz for text formats), a folder of them, "
            "or a datasets save_to_disk folder."
        ),
    ],
    model: Annotated[
        str | None, typer.Option(help="A local model folder: its tokenizer is used.")
    ] = None,
    tokenizer: Annotated[str | None, typer.Option(help="A local tokenizer folder.")] = None,
    text_column: Annotated[
        str, typer.Option(help="Text column(s), comma-separated: a row counts its longest.")
    ] = "text",
    max_seq_len: Annotated[
        int | None,
        typer.Option(help="Report what truncating (and padding) to this many tokens does."),
    ] = None,
    prompt_column: Annotated[
        str | None,
        typer.Option(help="Prompt/completion rows: the prompt column (with --completion-column)."),
    ] = None,
    completion_column: Annotated[
        str | None,
        typer.Option(help="Prompt/completion rows: a row is prompt + completion + eos."),
    ] = None,
    messages_column: Annotated[
        str | None,
        typer.Option(help="Chat rows: messages rendered with the tokenizer's chat template."),
    ] = None,
    packing: Annotated[
        bool,
        typer.Option(
            "--packing",
            help="Also report packing the rows (bfd, padding-free) into sequences of "
            "--max-seq-len tokens: rows per sequence, the padding it removes.",
        ),
    ] = False,
    skip_bad_rows: Annotated[
        bool,
        typer.Option(
            "--skip-bad-rows",
            help="Leave out the rows memfit train --skip-bad-rows leaves out (and count them).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Token lengths of a data set: percentiles, what truncation cuts, what padding wastes.

    Instruction rows (--prompt-column/--completion-column, --messages-column) are measured as
    memfit train --task causal-lm renders them. With --packing, what memfit train --packing
    (bfd) makes of them: each row truncated to --max-seq-len, the rows packed whole, best fit
    decreasing, into sequences of --max-seq-len tokens."""
    if model is not None and tokenizer is not None:
        raise UsageError("give --model or --tokenizer, not both (--tokenizer alone is enough)")
    if max_seq_len is not None and max_seq_len < 1:
        raise UsageError(f"--max-seq-len: {max_seq_len} is not a length (give 1 or more tokens)")
    if packing and max_seq_len is None:
        raise UsageError(
            "--packing: give --max-seq-len, the tokens of a packed sequence (memfit train's)"
        )
    # the rows as memfit train --task causal-lm reads them, with the same flags and checks
    problems = flag_problems(
        task="causal-lm",
        prompt_column=prompt_column,
        completion_column=completion_column,
        messages_column=messages_column,
        packing="bfd" if packing else None,
        text_column=text_column,
    )
    if problems:
        raise UsageError("\n".join(problems))
    with progress.status("loading transformers", subject=f"memfit data profile {file}"):
        # start-up: memfit.plan loads torch (and the profile transformers' tokenizer)
        from memfit.plan.data_profile import DataProfile, tokenizer_folder

        folder = tokenizer_folder(model, tokenizer, model_flag="--model")
        columns = [c.strip() for c in text_column.split(",") if c.strip()]
        progress.report("reading and tokenizing every row")
        profile = DataProfile.from_file(
            file,
            columns,
            folder,
            flag="FILE",
            prompt_column=prompt_column,
            completion_column=completion_column,
            messages_column=messages_column,
            skip_bad_rows=skip_bad_rows,
        )
    if profile.skipped_rows:
        sys.stderr.write(f"memfit: left out {profile.skipped_rows} bad rows (--skip-bad-rows)\n")
    report = profile.to_dict(max_seq_len)
    lines = profile.summary_lines(max_seq_len)
    if packing:
        assert max_seq_len is not None
        figures = packing_figures(profile.lengths.tolist(), max_seq_len)
        report["packing"] = {
            "strategy": "bfd",
            **figures.to_dict(),
            # what padding_removed is measured against: memfit train's --padding max_length,
            # not its default (each micro-batch padded to its longest row)
            "padding_removed_against": "max_length",
        }
        lines.append(_packing_line(figures))
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for line in lines:
            typer.echo(line)


def _packing_line(figures: Any) -> str:
    """What ``--packing`` prints: the packed sequences' padding, and against which padding of an
    unpacked run its gain is measured. memfit train pads each micro-batch to its longest row by
    default (--padding longest), and how much that pads depends on the micro-batch size and the
    order of the rows (shuffled, or --group-by-length), neither known here: the figure given is
    against every row padded to --max-seq-len (--padding max_length), with the default's said in
    words (none at micro-batch 1), not a made-up number."""
    return (
        f"packing       bfd into sequences of {figures.budget} tokens: "
        f"{figures.rows_per_sequence:.2f} rows per sequence ({figures.rows:,} rows in "
        f"{figures.sequences:,}); {figures.padding_share:.2%} of them is padding. Unpacked, "
        f"with every row padded to {figures.budget} (--padding max_length), "
        f"{figures.padded_share:.2%} is padding, {figures.padding_removed:.2%} of which packing "
        "removes; memfit train's default (--padding longest) pads each micro-batch only to its "
        "longest row, less than that (none at micro-batch 1), by how much depends on the "
        "micro-batch size and the order (--group-by-length), so the gain over it is smaller"
    )
