"""Input rows in (CSV / JSONL / Parquet, streamed), predictions out, and a synthetic ticket set.

Reading never raises for a bad row: the row comes back with `error` set and `text` None, so
every other row is still processed. Problems with the file as a whole (missing, unknown
format, no text column) raise `InputError`, whose message says what to do.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from slimroute.labels import Prediction

CLASSES = ("billing", "technical", "account")
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
_MISSING = object()
_JSONL_LOOKAHEAD = 100  # lines inspected to decide whether a JSONL file has the text column at all
_BOM = b"\xef\xbb\xbf"

# --------------------------------------------------------------------------- synthetic tickets


def _pool(block: str) -> tuple[str, ...]:
    """Templates one per line, short ones several to a line separated by ' | '."""
    return tuple(t.strip() for line in block.strip().splitlines() for t in line.split(" | "))


_OPENINGS = {
    "billing": _pool("""
I was charged {amount} twice for my {plan} subscription on {date}.
Why does my latest invoice show {amount} when the {plan} plan is supposed to cost less?
Please refund the {amount} you took from my {card} on {date}, I cancelled before the renewal.
My payment keeps getting declined even though my {card} works everywhere else.
I downgraded from {plan} last month but I'm still paying the old price.
Can I get a VAT invoice for the {amount} payment from {date}?
There is a charge of {amount} on my bank statement that I don't recognise.
How do I switch from monthly to yearly payments on the {plan} plan?
The promo code I entered at checkout didn't apply and I paid the full {amount}.
I need to update the card on file, the old {card} has expired.
You renewed my subscription automatically for {amount} without sending any reminder.
Our company needs the address on our invoices changed to the new office.
I was promised a prorated credit after upgrading to {plan}, but it never showed up.
Is there a student or nonprofit discount for the {plan} tier?
The receipt for order #{order} says {amount} but my bank shows a different amount.
I cancelled my free trial on {date} and got charged {amount} anyway.
Could you explain the extra {amount} service fee on this month's bill?
We pay for {n} seats but only {m} people on our team actually use {product}.
I'd like to pay by bank transfer instead of card, is that possible?
My refund of {amount} was approved on {date} but it still hasn't reached my account.
Money left my account for {product} but the order still shows as unpaid.
Charged twice this month, please fix.
"""),
    "technical": _pool("""
{product} crashes as soon as I open it on my {device}.
I keep getting error {code} when I try to use {feature}.
Since the update to version {version}, {feature} no longer works.
The page just spins forever in {browser} and my dashboard never loads.
Files I save on my {device} are not syncing to my other devices.
{product} has become extremely slow, every click takes several seconds.
The export keeps failing halfway through with a timeout message.
Notifications stopped arriving on my {device} around {date}.
When I upload a photo the app freezes and I have to force quit it.
The API returns {code} for every request since this morning.
I can't install {product} on my {device}, the installer quits with {code}.
Search returns nothing, even for documents I know are there.
Buttons overlap and the whole layout is broken in {browser} on my {device}.
The Outlook integration duplicates every calendar event it touches.
My work from {date} seems to have disappeared after the app restarted.
Video calls drop after about a minute with a connection error.
Offline mode doesn't work, nothing opens when I have no signal.
The desktop app sits at 100% CPU and the fan never stops.
In dark mode some of the text in settings is invisible.
Is there an outage? {product} shows {code} for everyone in our office.
{feature} worked yesterday and today it just shows a blank screen.
App won't open on my {device}.
"""),
    "account": _pool("""
I can't log in, it says my password is wrong even right after resetting it.
I never received the password reset email at {email}.
How do I change the email address on my profile to {email}?
Please delete my account and all the personal data you hold about me.
My account got locked after too many sign-in attempts.
I lost my phone and now I can't get the two-factor code to sign in.
Someone seems to have signed into my account from another country.
I'd like to change my username from {name}{n} to something else.
How do I make {name} from my team an admin of our workspace?
I ended up with two accounts by mistake and want to merge them.
The verification link in the sign-up email says it has expired.
How can I download a copy of all the data linked to my profile?
I want to hand ownership of the workspace to {name} before I leave the company.
My profile shows someone else's name and picture.
Can I sign in with Google instead of a password?
I got an email saying my login details were changed, but that wasn't me.
I left my old job and no longer have access to {email}, which is my login.
Please remove {name} from our organisation, they don't work here anymore.
How do I turn off two-factor authentication for my profile?
The security questions on my account don't match the ones I set up.
The invite {name} sent me to join their workspace doesn't let me create a login.
Can't get into my account.
"""),
}
_CONTEXT = {
    "billing": _pool("""
My plan is {plan} and I pay monthly. | I've attached a screenshot of the bank statement.
The order number is #{order}. | This is the second time this has happened with my bill.
I just want the money back, not store credit. | The card on the account is my {card}.
Our finance team needs this sorted before the end of the quarter.
The billing page still lists the old price of {amount}. | I was never told the price would go up.
My bank says the charge came from you on {date}.
I'd rather not dispute it with my bank if we can fix it here.
We were on {plan} for {years} years without a single problem with payments.
"""),
    "technical": _pool("""
I'm on a {device} with the latest system update. | It happens in {browser} and in the app.
The error message just says {code}. | I'm running version {version}. | It started around {date}.
Other people on my team see exactly the same thing. | It happens every single time, not just now and then.
The logs show {code} right before it stops. | My internet connection is fine, everything else works.
It only happens with large files, small ones are fine. | I can reproduce it on a second {device} too.
Nothing useful shows up in the console.
"""),
    "account": _pool("""
My login email is {email}. | I set the account up years ago and may have used an old address.
I've checked my spam folder. | I no longer have the phone number that's on the account.
I can send ID to prove who I am if needed. | The username on the account is {name}{n}.
Nobody else should have my password. | I'm the only admin on our workspace.
I tried to sign in on {date} and it worked then. | All my files are in this account so I really need access.
I think my old address was {email} but I'm not sure. | I don't remember setting up two-factor.
"""),
}
_ACTIONS = {
    "billing": _pool("""
contacted my bank | checked the billing history page | removed and re-added my card | tried a different card
used the chat on your website | emailed the billing address | waited for the next billing cycle
downloaded every invoice from this year | compared the charges with the price of {plan}
asked our accounts department to look | cancelled and resubscribed
checked whether {name} had bought an extra seat
"""),
    "technical": _pool("""
restarted my {device} | reinstalled {product} | cleared the cache and cookies | tried it in {browser}
turned off my VPN | logged out and back in | updated to version {version}
switched from wifi to mobile data | disabled all extensions | rolled back to the previous version
checked your status page | ran the app in safe mode
"""),
    "account": _pool("""
requested another reset link | checked my spam and junk folders | tried the recovery codes
used a private browsing window | asked {name} to send a new invite | tried signing in from another device
changed my password on the other service | answered the security questions
waited the 24 hours the lockout message mentions | tried every email address I own
looked for the account under {email} | reset my password twice
"""),
}
_OUTCOMES = _pool("""
but nothing changed | which didn't help at all | and the problem came back a day later
and got exactly the same result | but I never got a reply | and it seemed fine for about an hour
which honestly made it worse | but that didn't fix it | and still no luck
and for a moment I thought that was it | but it was the same story
""")
_STEPS = _pool("""
On {date} I {action}, {outcome}. | Then I {action}, {outcome}. | After that I {action}, {outcome}.
I also {action}, {outcome}. | Someone on a forum said to try this, so I {action}, {outcome}.
Next I {action}, {outcome}. | On a friend's advice I {action}, {outcome}.
""")
_GENERIC = _pool("""
I've been a customer for {years} years. | I use this every day for work. | This is really urgent for me.
Sorry if this is the wrong place to ask. | I'm not very technical, so please keep it simple.
I run a small business and rely on this. | I already searched your help centre but couldn't find an answer.
It's quite frustrating. | English is not my first language, sorry for any mistakes.
I'm writing on behalf of my father. | Some background: we moved over from another tool about {n} months ago.
I'd really like to keep using the product, but this is becoming a problem.
I recommended you to {m} friends, so I'd like this sorted. | I'm travelling this week.
""")
_GREETINGS = _pool("""
Hi, | Hello, | Hi there, | Dear support team, | Hey, | Good morning, | Hello team,
""")
_CLOSINGS = _pool("""
Thanks in advance. | Thanks! | Any help appreciated. | Please get back to me soon. | Regards, {sender}
Cheers, {sender} | Thank you for your time. | Thanks, {sender}
""")
_SLOTS = {
    "product": ("Nimbus Drive", "the Nimbus app", "the desktop client", "the web dashboard", "PaperTrail",
                "the browser extension", "Nimbus Notes", "the reporting module"),
    "plan": ("Basic", "Plus", "Pro", "Team", "Business", "Enterprise", "Family", "Student"),
    "device": ("iPhone 13", "Pixel 7", "Galaxy S22", "MacBook Air", "Windows 11 laptop", "iPad",
               "Chromebook", "Surface Pro", "Ubuntu desktop", "Android tablet"),
    "browser": ("Chrome", "Firefox", "Safari", "Edge", "Brave"),
    "feature": ("file sync", "the PDF export", "search", "the calendar view", "photo upload",
                "offline mode", "shared folders", "the mobile widget", "the CSV import"),
    "name": ("Anna", "Ben", "Carlos", "Dana", "Emeka", "Fatima", "Greg", "Hiro", "Ines", "Jonas", "Priya"),
    "card": ("Visa", "Mastercard", "Amex", "debit card"),
    "domain": ("gmail.com", "outlook.com", "example.org", "proton.me", "yahoo.co.uk"),
}
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December")


def _slot_values(rng: random.Random) -> dict[str, str]:
    values = {key: rng.choice(options) for key, options in _SLOTS.items()}
    values["card"] = f"{values['card']} ending in {rng.randint(1000, 9999)}"
    values["email"] = f"{rng.choice(_SLOTS['name']).lower()}{rng.randint(1, 99)}@{values.pop('domain')}"
    values["sender"] = rng.choice([name for name in _SLOTS["name"] if name != values["name"]])
    values["version"] = f"{rng.randint(2, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}"
    return values


def _ordinal(day: int) -> str:
    suffix = "th" if 11 <= day <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def _fresh_values(rng: random.Random) -> dict[str, str | int]:
    """Slots that change from sentence to sentence within one ticket."""
    month, day = rng.choice(_MONTHS), rng.randint(1, 28)
    date = rng.choice((f"{month} {day}", f"{day} {month}", f"{month[:3]} {day}", f"the {_ordinal(day)}"))
    amount = f"{rng.choice('$$$€£')}{rng.randint(3, 300)}.{rng.choice(('00', '99', '49', '50'))}"
    code = f"{rng.choice(('E', 'ERR-', '0x', 'code ', 'E_'))}{rng.randint(100, 9999)}"
    n = rng.randint(3, 30)
    return {"date": date, "amount": amount, "code": code, "order": rng.randint(10000, 999999),
            "n": n, "m": rng.randint(2, n - 1), "years": rng.randint(2, 12)}


def _fill(rng: random.Random, template: str, fixed: dict[str, str], **extra: str) -> str:
    return template.format(**fixed, **_fresh_values(rng), **extra)


def _pick(rng: random.Random, pool: tuple[str, ...], used: set[str]) -> str:
    """A template not used yet in this ticket, while there are any."""
    choice = rng.choice([t for t in pool if t not in used] or pool)
    used.add(choice)
    return choice


def _history_step(rng: random.Random, label: str, fixed: dict[str, str], used: set[str]) -> str:
    action = _fill(rng, _pick(rng, _ACTIONS[label], used), fixed)
    outcome = _pick(rng, _OUTCOMES, used)
    return _fill(rng, _pick(rng, _STEPS, used), fixed, action=action, outcome=outcome)


def _context(rng: random.Random, label: str, fixed: dict[str, str], used: set[str], long: bool) -> str:
    kind = rng.random()
    if long and kind > 0.4:  # long tickets are mostly a history of what was already tried
        return _history_step(rng, label, fixed, used)
    pool = _CONTEXT[label] if kind < (0.25 if long else 0.6) else _GENERIC
    return _fill(rng, _pick(rng, pool, used), fixed)


def _ticket_text(rng: random.Random, label: str) -> str:
    fixed, used = _slot_values(rng), set()
    body = [_fill(rng, rng.choice(_OPENINGS[label]), fixed)]
    if rng.random() < 0.08:  # the long tail: about 120-450 words, log-uniform
        target = int(math.exp(rng.uniform(math.log(120), math.log(430))))
        while sum(len(s.split()) for s in body) < target:
            body.append(_context(rng, label, fixed, used, long=True))
    else:
        for _ in range(rng.choices((0, 1, 2, 3, 4), weights=(30, 35, 20, 10, 5))[0]):
            body.append(_context(rng, label, fixed, used, long=False))
    if rng.random() < 0.45:
        body.insert(0, rng.choice(_GREETINGS))
    if rng.random() < 0.5:
        body.append(_fill(rng, rng.choice(_CLOSINGS), fixed))
    text = " ".join(body)
    return text.lower() if rng.random() < 0.07 else text


def synthetic_tickets(n: int = 600, seed: int = 0) -> list[dict]:
    """Deterministic, distinct customer-support tickets, balanced over CLASSES, long-tailed in length."""
    if n < 0:
        raise ValueError(f"n must be a non-negative number of tickets, got {n}")
    rng = random.Random(seed)
    labels = [CLASSES[i % len(CLASSES)] for i in range(n)]
    rng.shuffle(labels)
    tickets, seen = [], set()
    for i, label in enumerate(labels):
        text = _ticket_text(rng, label)
        while text.lower() in seen:  # a short ticket can come out identical to an earlier one
            text = _ticket_text(rng, label)
        seen.add(text.lower())
        tickets.append({"id": f"t{i:05d}", "text": text, "label": label})
    return tickets


def ticket_length_summary(tickets: list[dict]) -> dict[str, float]:
    """Word-count statistics of the tickets' texts (nearest-rank percentiles)."""
    if not tickets:
        raise ValueError("ticket_length_summary needs at least one ticket, got an empty list")
    counts = sorted(len(t["text"].split()) for t in tickets)

    def pct(q: float) -> int:
        return counts[min(len(counts) - 1, max(0, math.ceil(q * len(counts)) - 1))]

    return {"count": len(counts), "min": counts[0], "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": counts[-1], "mean": round(sum(counts) / len(counts), 1)}


# --------------------------------------------------------------------------- reading inputs


class InputError(ValueError):
    """A usage error about the input file; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class Row:
    index: int  # 0-based row number in the input (blank lines are not rows)
    id: str  # value of the id column as str, else str(index)
    text: str | None  # None when the row has an error
    gold: str | None  # gold label if a label column exists and is filled in, else None
    error: str | None  # per-row problem, else None


@dataclass(frozen=True)
class _Columns:
    text: str
    id: str
    label: str | None  # None: no gold labels


def _format_of(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"file {str(path)!r} has an unsupported extension {path.suffix!r}; "
                         f"use one of {', '.join(FORMATS)}")
    return fmt


def _check_input(path) -> tuple[Path, str]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"input file {str(path)!r} does not exist; check the path")
    return path, _format_of(path)


def _has_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _clean(value: str) -> str:
    """Replace undecodable bytes (kept as surrogates) with U+FFFD so the value can be written out."""
    if not _has_surrogates(value):
        return value
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in value)


def _resolve_columns(path: Path, available: list[str], text: str, id_: str, label: str | None) -> _Columns:
    """Check the file-level columns; `label=None` means 'label' if present, else no gold."""
    listed = ", ".join(repr(c) for c in available) or "none"
    if text not in available:
        raise InputError(f"text column {text!r} is not in {str(path)!r}; available columns: {listed}. "
                         "Pass --text-column with the column that holds the text")
    if label is not None and label not in available:
        raise InputError(f"label column {label!r} is not in {str(path)!r}; available columns: {listed}. "
                         "Pass --label-column with the column that holds the gold labels, or leave it out")
    if id_ != "id" and id_ not in available:
        raise InputError(f"id column {id_!r} is not in {str(path)!r}; available columns: {listed}. "
                         "Pass --id-column with the column that holds the ids, or leave it out")
    if label is None and "label" in available:
        label = "label"
    return _Columns(text, id_, label)


def _text_of(record: Mapping, column: str) -> tuple[str | None, str | None]:
    value = record.get(column, _MISSING)
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "text is not valid UTF-8"
    if value is _MISSING:
        return None, f"text column {column!r} is missing in this row"
    if value is None:
        return None, "text is null"
    if not isinstance(value, str):
        return None, f"text is not a string (got {type(value).__name__})"
    if _has_surrogates(value):
        return None, "text is not valid UTF-8"
    if not value.strip():
        return None, "text is empty"
    return value, None


def _optional_str(value) -> str | None:
    if value is None or value is _MISSING:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    value = _clean(str(value)).strip()
    return value or None


def _make_row(index: int, record: Mapping, cols: _Columns) -> Row:
    text, error = _text_of(record, cols.text)
    gold = _optional_str(record.get(cols.label)) if cols.label else None
    return Row(index, _optional_str(record.get(cols.id)) or str(index), text, gold, error)


def _error_row(index: int, error: str) -> Row:
    return Row(index, str(index), None, None, error)


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    """Non-blank lines, BOM stripped."""
    with path.open("rb") as f:
        for number, line in enumerate(f):
            if number == 0 and line.startswith(_BOM):
                line = line[len(_BOM):]
            if line.strip():
                yield line


def _parse_jsonl(line: bytes) -> tuple[object, str | None]:
    try:
        obj = json.loads(line.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as e:
        return None, f"row is not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(obj, dict):
        return None, f"row is not a JSON object (got {type(obj).__name__})"
    return obj, None


def _jsonl_columns(path: Path, text: str, id_: str, label: str | None) -> _Columns:
    """JSONL has no header: the columns are the keys seen in the first objects of the file."""
    seen: dict[str, None] = {}
    for number, line in enumerate(_jsonl_lines(path)):
        obj, _ = _parse_jsonl(line)
        if obj is not None:
            seen.update(dict.fromkeys(obj))
            if text in seen and (label is None or label in seen) and (id_ == "id" or id_ in seen):
                break
        if number + 1 >= _JSONL_LOOKAHEAD:
            break
    if not seen:  # nothing parses: report it row by row
        return _Columns(text, id_, label or "label")
    cols = _resolve_columns(path, list(seen), text, id_, label)
    return _Columns(cols.text, cols.id, label or "label")  # 'label' read per row when present


def _iter_jsonl(path: Path, cols: _Columns) -> Iterator[Row]:
    for index, line in enumerate(_jsonl_lines(path)):
        obj, error = _parse_jsonl(line)
        yield _error_row(index, error) if error else _make_row(index, obj, cols)


def _open_csv(path: Path):
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # long texts are legitimate
    return path.open(encoding="utf-8-sig", errors="surrogateescape", newline="")


def _csv_records(path: Path) -> Iterator[list[str]]:
    """CSV records, header first; blank lines are not records."""
    with _open_csv(path) as f:
        reader = csv.reader(f)
        try:
            yield from (values for values in reader if values)
        except csv.Error as e:
            raise InputError(f"{str(path)!r} is not valid CSV near line {reader.line_num}: {e}; "
                             "fix the quoting or convert the file to JSONL") from e


def _iter_csv(path: Path, header: list[str], cols: _Columns) -> Iterator[Row]:
    records = _csv_records(path)
    next(records)
    for index, values in enumerate(records):
        yield _make_row(index, dict(zip(header, values, strict=False)), cols)


def _iter_parquet(pf: pq.ParquetFile, cols: _Columns, batch_size: int = 1024) -> Iterator[Row]:
    names = pf.schema_arrow.names
    wanted = [c for c in dict.fromkeys((cols.text, cols.id, cols.label)) if c in names]
    index = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=wanted):
        data = batch.to_pydict()
        for i in range(batch.num_rows):
            yield _make_row(index, {c: data[c][i] for c in wanted}, cols)
            index += 1


def _open_parquet(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{str(path)!r} is not a readable Parquet file ({e}); check the file") from e


def iter_rows(path, text_column: str = "text", id_column: str = "id",
              label_column: str | None = None) -> Iterator[Row]:
    """Stream the rows of a .csv / .jsonl / .ndjson / .parquet file.

    File-level problems raise InputError here, before the first row is read; row problems never raise.
    """
    path, fmt = _check_input(path)
    if fmt == "csv":
        header = next(_csv_records(path), None)
        if header is None:  # an empty file has no rows
            return iter(())
        header = [_clean(h) for h in header]
        return _iter_csv(path, header, _resolve_columns(path, header, text_column, id_column, label_column))
    if fmt == "parquet":
        pf = _open_parquet(path)
        return _iter_parquet(pf, _resolve_columns(path, pf.schema_arrow.names, text_column, id_column,
                                                  label_column))
    return _iter_jsonl(path, _jsonl_columns(path, text_column, id_column, label_column))


def read_rows(path, text_column: str = "text", id_column: str = "id",
              label_column: str | None = None) -> list[Row]:
    return list(iter_rows(path, text_column, id_column, label_column))


def count_rows(path) -> int | None:
    """Number of rows, cheaply, for progress bars; None when it cannot be told."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    try:
        if fmt == "parquet":
            return pq.ParquetFile(path).metadata.num_rows
        if fmt == "jsonl":
            return sum(1 for _ in _jsonl_lines(path))
        if fmt == "csv":
            return max(0, sum(1 for _ in _csv_records(path)) - 1)
    except (OSError, InputError, pa.ArrowException):
        return None
    return None


# --------------------------------------------------------------------------- writing predictions


def output_columns(labels: list[str]) -> list[str]:
    return ["id", "label", *(f"p_{label}" for label in labels), "truncated", "error"]


def output_record(row: Row, pred: Prediction, labels: list[str]) -> dict:
    """One output row; an error row (from the input or the model) has no label and no probabilities."""
    error = row.error or pred.error
    probs = {} if error else pred.probs
    record: dict = {"id": row.id, "label": None if error else pred.label}
    record.update({f"p_{label}": probs.get(label) for label in labels})
    record.update({"truncated": bool(pred.truncated), "error": error})
    return record


def output_schema(labels: list[str]) -> pa.Schema:
    fields = [pa.field("id", pa.string()), pa.field("label", pa.string())]
    fields += [pa.field(f"p_{label}", pa.float64()) for label in labels]
    return pa.schema(fields + [pa.field("truncated", pa.bool_()), pa.field("error", pa.string())])


def _csv_cell(value) -> object:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def encode_records(fmt: str, records: list[dict], header: list[str] | None = None) -> str:
    """JSONL or CSV text of output records, exactly as PredictionWriter writes them (CSV: header first
    when given). Deterministic: floats are written as their shortest repr."""
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf)  # \r\n line ends: then a lone \r in a value is quoted
        if header is not None:
            writer.writerow(header)
        writer.writerows([_csv_cell(v) for v in rec.values()] for rec in records)
        return buf.getvalue()
    return "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)


class PredictionWriter:
    """Append batches of predictions to a .csv / .jsonl / .parquet file (format by extension)."""

    def __init__(self, path, labels: list[str]):
        self.path, self.labels = Path(path), list(labels)
        self.format = _format_of(self.path)
        if not self.labels or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be a non-empty list of distinct labels, got {self.labels!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._parquet = None
        self._schema = output_schema(self.labels)
        if self.format == "parquet":
            self._parquet = pq.ParquetWriter(self.path, self._schema)
        else:
            self._file = self.path.open("w", encoding="utf-8", newline="")
            if self.format == "csv":
                self._file.write(encode_records("csv", [], output_columns(self.labels)))

    def write(self, rows: list[Row], preds: list[Prediction]) -> None:
        """Append one batch, in the given order (one Parquet row group per call)."""
        if len(rows) != len(preds):
            raise ValueError(f"write got {len(rows)} rows but {len(preds)} predictions; pass one per row")
        if self._file is None and self._parquet is None:
            raise ValueError(f"PredictionWriter for {str(self.path)!r} is closed; open a new one to write")
        records = [output_record(r, p, self.labels) for r, p in zip(rows, preds, strict=True)]
        if not records:
            return
        if self._parquet is not None:
            table = pa.Table.from_pylist(records, schema=self._schema)
            self._parquet.write_table(table, row_group_size=len(records))
        else:
            self._file.write(encode_records(self.format, records))

    def close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
            self._parquet = None
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None

    def __enter__(self) -> PredictionWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
