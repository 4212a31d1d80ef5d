"""Synthetic customer-support tickets (billing / technical / account) with gold labels: deterministic,
distinct, balanced over the classes and long-tailed in length, like a real queue."""

from __future__ import annotations

import math
import random

CLASSES = ("billing", "technical", "account")


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
