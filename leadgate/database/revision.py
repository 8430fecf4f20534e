"""The schema revision this release needs: the newest under
``leadgate/database/migrations/versions`` (``tests/unit/test_schema_revision.py`` checks it
is Alembic's head, so a new migration that forgets it fails the suite).

A constant, not Alembic's ``ScriptDirectory``, because reading that imports Alembic and
every migration file, about 0.1 s that each ``leadgate`` command and ``--version`` spent
before doing anything.
"""

HEAD = "0030"
