"""Code contents may be stored compressed: code_blobs.encoding

NULL: ``data`` is the content as uploaded (every row before this revision); "zstd": one
zstd frame of it, as a client sent it in a pack (POST /code/packs). ``size`` and the
digest stay those of the uncompressed content.

Revision ID: 0021
Revises: 0018
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("code_blobs") as batch:
        batch.add_column(sa.Column("encoding", sa.String(length=16), nullable=True))


def downgrade() -> None:
    # Compressed rows cannot be read by the older code: store them uncompressed first.
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT digest FROM code_blobs WHERE encoding = 'zstd'"))
    digests = [r[0] for r in rows]
    if digests:
        from ddpq import pack

        for digest in digests:
            data, size = bind.execute(
                sa.text("SELECT data, size FROM code_blobs WHERE digest = :d"), {"d": digest}
            ).one()
            plain = pack.decompress(bytes(data), int(size))
            bind.execute(
                sa.text("UPDATE code_blobs SET data = :data WHERE digest = :d"),
                {"data": plain, "d": digest},
            )
    with op.batch_alter_table("code_blobs") as batch:
        batch.drop_column("encoding")
