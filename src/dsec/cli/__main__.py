from dsec.cli.main import app

app()
