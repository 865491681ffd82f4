"""Agree: one collective per boundary, and a verdict (plus its report) from a pure function of what every rank sent;
the top-K vote rides in it. ``GradientGuard`` is recording and agreement without a Trainer."""
